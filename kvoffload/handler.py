"""DirectionHandler: one direction's jobs, from submit to result.

Owns: its backend (copy streams and events, or the host copy), the FIFO of in-flight transfers, and
one issuer thread (none over a hands-off backend, whose thread is its own). Borrows: the copy
plan's addresses (the device tensors and the host records belong to the layout and the region;
the worker keeps them alive for longer than this handler) and its job book (:class:`~kvoffload._jobs.JobBook`: its own, or the worker's shared one), where it
publishes results.

``submit`` validates everything before touching the device, captures the compute-stream fence in the
caller's thread (so the job waits for the work queued before the call), appends the transfer to the
FIFO and hands it to the issuer thread, which builds the descriptors and enqueues the copies (the
driver's per-page cost is paid there, with the GIL released in the driver). A job cheap to issue
(:data:`INLINE_ISSUE_MAX_DESCRIPTORS`) is issued on the caller's thread when nothing else is queued;
a costlier one with nothing in flight, and a layered load's layer 0, are issued there as a *head*
and the rest on the issuer thread: the link starts at once, the caller pays for one chunk or layer,
and the head's result rides with the rest's (the job still completes as a whole), unless a backend
that chooses its path by size (``path_for``) would move the head or the rest on another path than the
whole job's: then the job goes whole to the thread. A backend whose
``hands_off`` is true (the native issuer, docs/design.md §16) only hands a job to a thread of its
own: every job is issued whole on the caller's thread, never split, and the handler starts no
thread (:attr:`DirectionHandler.thread_stopped` then reads the backend's).

Jobs of one direction run in submission order, so they finish in it: completion pops finished
transfers from the head only. A job that fails to issue or to complete comes back as a result with
``ok=False`` and its error; it is never dropped and never counted as done.

Shutdown contract (docs/design.md §6): look at the head transfer, wait for its end (with the
deadline), pop it only after the wait succeeded. If a wait raises or passes the deadline: log it,
stop the issuer from issuing anything more, clear the queue, keep the error, stop waiting. Then
release the backend and join the issuer thread *unconditionally*. Finally re-raise the kept error
(several failures come as one :class:`~kvoffload.errors.ShutdownError`). A second ``shutdown`` does
nothing; every other call after it raises :class:`~kvoffload.errors.ClosedError`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Final, Protocol, TypeVar, cast, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload._descriptors import CopyPlan, PageTable, mostly_apart
from kvoffload._jobs import BookedResult, FailedTicket, JobBook, Ticket, as_job_id, as_timeout
from kvoffload._layer_groups import GroupedMarks, group_size, grouped
from kvoffload._layer_load import LayerMarks, WholeJobMarks
from kvoffload._validate import as_block_ids, check_pairs
from kvoffload.errors import (
    ClosedError,
    DeviceMismatchError,
    ShutdownError,
    TransferError,
    WaitTimeoutError,
)
from kvoffload.records import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    BlockIds,
    Direction,
    DriverCallStats,
    HandlerStats,
    TransferResult,
)

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT_S", "Backend", "BookedHandler", "DirectionHandler", "LayeredBackend",
           "Ticket"]

_T = TypeVar("_T")
_log = logging.getLogger("kvoffload.handler")
#: Transfers abandoned by a failed drain: their tickets keep host buffers a copy may still read, so
#: they are kept for the rest of the process rather than freed under a running copy.
_ABANDONED: list[object] = []

I64Array = npt.NDArray[np.int64]

#: A job whose issue builds at most this many descriptors (``Backend.issue_cost``: a page each for
#: batched DMA, a block and a share of each chunk for the kernel paths) is issued on the caller's
#: thread when no other job is queued or being issued: it saves the thread handoff.
INLINE_ISSUE_MAX_DESCRIPTORS: Final = 256
#: A costlier job with no job in flight is split: its first pairs, of at most this cost (halving the
#: count until it fits; one pair at least), are issued on the caller's thread, so the link starts
#: without waiting for the issuer thread to win the GIL from a caller that keeps submitting.
INLINE_HEAD_MAX_DESCRIPTORS: Final = 128
#: The issuer thread (the handler's, or the backend's own in its release) is waited for at least this
#: long even when the deadline has passed: an idle thread stops within microseconds, and only a
#: thread stuck in a copy should count as running.
ISSUER_JOIN_MIN_S: Final = 0.05
_EMPTY_PATH: Final = "none"
#: The range of a booked job's key (:class:`BookedHandler`): a signed 64-bit int.
_KEY_MIN: Final = -(1 << 63)
_KEY_END: Final = 1 << 63
#: The error of a job whose handler shut down before it was issued.
_SHUT_DOWN: Final = "the handler shut down before the job was issued"


# ------------------------------------------------------------------------------- the seam


class Backend(Protocol):
    """Where one direction's copies run (see the module docstring)."""

    name: str
    direction: Direction

    @property
    def path(self) -> str:
        """The transfer-path name reported in results."""

    def fence(self, stream: object | None) -> object:
        """Capture the compute-stream position the next job must wait for (caller's thread).

        Raises:
            DeviceMismatchError: ``stream`` is not a stream of the backend's device.
        """

    def release_fence(self, fence: object) -> None:
        """Give back a fence from :meth:`fence` once no job that waits for it is left to issue."""

    def start_thread(self) -> None:
        """Prepare the calling (issuer) thread for :meth:`issue`."""

    def can_issue_here(self) -> bool:
        """Whether :meth:`issue` may run on the calling thread (a submitter's) as it is."""

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """Host work of issuing ``pairs`` blocks, in descriptors built and handed to the driver (what
        the handler weighs to issue a job, or its head, on the caller's thread)."""

    def issue(self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> Ticket:
        """Enqueue the copies of the pairs ``(src[i], dst[i])`` behind ``fence`` (issuer thread);
        never raises: a failure is the ticket's ``error``."""

    def release(self) -> None:
        """Drop streams and events; called once, after the last ticket completed or was abandoned.
        A backend with a thread of its own to stop may offer ``release_within(timeout)`` instead
        (:class:`ReleasedWithin`), which the handler then calls with the shutdown's time left."""


@runtime_checkable
class ReleasedWithin(Protocol):
    """A backend whose release waits for a thread of its own (the native issuer's): the handler
    calls :meth:`release_within` in place of ``release``, so that a shutdown stays within its
    deadline (docs/design.md §6)."""

    def release_within(self, timeout: float) -> None:
        """``release``, waiting at most ``timeout`` seconds for its thread to stop."""


class LayeredBackend(Backend, Protocol):
    """A backend that marks a load's layers as they land (docs/design.md §12). Optional: a handler
    over a backend without these methods makes every layer wait for the whole job, on the host."""

    def layer_marks(self, count: int) -> LayerMarks:
        """Fresh marks for a job of ``count`` layers (caller's thread, before the issue)."""

    def issue_layers(
        self, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array, fence: object,
        marks: LayerMarks, first: int = 0,
    ) -> Ticket:
        """As :meth:`Backend.issue`, layer after layer (``plans[i]`` moves layer ``first + i``),
        marking each in ``marks`` once its copies are enqueued; never raises."""


@runtime_checkable
class CallStatsSource(Protocol):
    """A backend that counts where its callers waited inside the driver (the native issuer)."""

    def call_stats(self) -> DriverCallStats:
        """Its :class:`~kvoffload.records.DriverCallStats` so far."""


class HandsOffBackend(Backend, Protocol):
    """A backend whose ``issue`` only hands the job to a thread of its own (docs/design.md §16):
    cheap whatever the job's size, so the handler issues every job on the caller's thread, in
    submit order, never splits one, and takes its own fences with :meth:`position`. One that also
    books its jobs (:class:`BookingBackend`) gets a :class:`BookedHandler`, whose fast-front calls
    hand a job over with its fence recorded on a stream in the same call."""

    hands_off: bool

    def position(self, stream: object | None) -> object:
        """A fence the next :meth:`~Backend.issue` on this thread records (with the hand-off), for
        a job issued before the submit returns; given back with ``release_fence`` as any.

        Raises:
            DeviceMismatchError: ``stream`` is not a stream of the backend's device.
        """

    def stream_handle(self, stream: object | None) -> int:
        """The handle of ``stream`` (None: the device's current stream).

        Raises:
            DeviceMismatchError: ``stream`` is not a stream of the backend's device.
        """

    def current_stream_reader(self) -> Callable[[], int]:
        """A call without arguments that returns the calling thread's current stream's handle."""

    def layer_marks(self, count: int) -> LayerMarks:
        """Marks for a layered job of ``count`` layers."""

    def early_wake(self, pages: int) -> tuple[int, Callable[[], object]] | None:
        """For jobs of ``pages`` pages per pair: the fewest pairs of a job whose thread is best
        woken as soon as the job is taken, and the call that wakes it (None: never)."""

    def thread_stopped_reader(self) -> Callable[[], bool]:
        """A call without arguments, valid after the release too: True once the backend's thread
        stopped (it can enqueue no more copies)."""


class BookingBackend(HandsOffBackend, Protocol):
    """A hands-off backend that keeps its jobs in a book of its own, in hand-off order, until their
    results are taken in one call (the native issuer's library; docs/design.md §16): its handler
    (:class:`BookedHandler`) keeps no object per job."""

    books: bool

    def booked_hand_off_call(self, plans: tuple[CopyPlan, ...], *, whole: bool) -> Callable[..., int]:
        """A call ``(job_id, src, dst, stream, marks=None)`` that hands a job over as booked: 0, or
        the code it failed with unbooked; never raises."""

    def issue_booked(self, job_id: int, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array,
                     fence: object, marks: LayerMarks | None, first: int = 0) -> int:
        """Hand a job over as booked behind ``fence``; returns as ``booked_hand_off_call``'s call."""

    def book_fail(self, job_id: int, pairs: int, error: BaseException) -> bool:
        """Book a job as failed with ``error`` before it was handed over; False: not booked."""

    def book_take(self) -> list[BookedResult]:
        """The results of the finished jobs at the head of the book, in hand-off order."""

    def book_wait(self, job_id: int | None, timeout_s: float) -> bool:
        """Wait until the first job not done among job ``job_id`` (None: the last booked) and those
        booked before it is done; True when it is, or none is left."""

    def close_book(self, timeout_s: float) -> None:
        """Book no job any more (a drain's last look), waiting at most ``timeout_s`` for a hand-off
        in progress.

        Raises:
            WaitTimeoutError: a hand-off was still in progress (inside a driver call) at the
                deadline; the book is closed to later hand-offs all the same.
        """

    def book_count(self) -> tuple[int, int | None, int]:
        """The jobs in the book, the first one's id, and how many were ever booked."""

    def book_error(self, code: int) -> BaseException:
        """The error of a job a booked hand-off did not book (it returned ``code``)."""


@attrs.define(eq=False)
class _Transfer:
    job_id: int
    src: I64Array
    dst: I64Array
    nbytes: int
    fence: object
    owns_fence: bool  # the handler took the fence (and gives it back once the job was issued)
    issued: bool = False  # set under the handler's lock, with a notify of ``_issued``
    ticket: Ticket | None = None
    layers: tuple[CopyPlan, ...] | None = None  # a layered load: one plan per layer
    marks: LayerMarks | None = None  # owned from submit until the result is published
    head: bool = False  # the first part of a split job: its outcome rides with the next transfer
    carried: TransferResult | None = None  # the outcome of this job's head part
    first_layer: int = 0  # the layer ``layers[0]`` moves
    wait_failure: BaseException | None = None  # its ticket's wait raised: the job fails with it


class DirectionHandler:
    """Submits, tracks and drains the jobs of one direction (see the module docstring).

    Build it with :meth:`create`; ``__init__`` only stores fields (tests build it with fakes).
    Methods may be called from several threads; none blocks on a device event while holding the
    handler's lock.
    """

    #: Completions are looked for (device events), not pushed by a thread of the handler.
    pushes = False

    def __init__(
        self,
        *,
        direction: Direction,
        plan: CopyPlan,
        backend: Backend,
        num_src_blocks: int,
        num_dst_blocks: int,
        book: JobBook | None = None,
    ) -> None:
        self.direction = direction
        self.num_src_blocks = num_src_blocks
        self.num_dst_blocks = num_dst_blocks
        self._plan = plan
        self._backend: Backend | None = backend
        self._path = backend.path
        self._page_bytes = int(plan.pages.block_bytes)
        self._owns_book = book is None
        self._book = book if book is not None else JobBook()
        self._book.attach(self)
        self._lock = threading.Lock()
        self._issued = threading.Condition(self._lock)  # notified when a transfer was issued
        self._issue_waiters = 0  # threads waiting on ``_issued`` (under the lock)
        self._fifo: collections.deque[_Transfer] = collections.deque()
        self._queue: queue.SimpleQueue[_Transfer | None] = queue.SimpleQueue()
        self._issue_lock = threading.Lock()  # held while a job is being issued: one at a time
        self._pending = 0  # jobs queued or being issued
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped: Callable[[], bool] | None = None  # a hands-off backend's thread's state
        self._closed = False
        self._submitted = 0
        self._completed = 0
        self._failed = 0
        self._bytes_done = 0
        self._busy_s = 0.0
        #: the plans of each table set's layered jobs (the layout's layers, their groups), by id:
        #: the worker and the calibration pass a layout's own tuple, so a few entries a handler
        self._layer_plans: dict[int, tuple[tuple[PageTable, ...], tuple[CopyPlan, ...]]] = {}
        #: per the layout's layer tables (by id): the layers a group holds and the groups
        self._groups: dict[int, tuple[tuple[PageTable, ...], int, tuple[PageTable, ...]]] = {}

    @classmethod
    def create(
        cls,
        *,
        direction: Direction,
        plan: CopyPlan,
        backend: Backend,
        num_src_blocks: int,
        num_dst_blocks: int,
        book: JobBook | None = None,
    ) -> DirectionHandler:
        """A handler with its issuer thread started.

        ``book``: where results are published (the worker shares one between its components);
        None gives the handler a book of its own, released with it.
        """
        made = BookedHandler if getattr(backend, "books", False) and cls is DirectionHandler else cls
        handler = made(
            direction=direction, plan=plan, backend=backend, num_src_blocks=num_src_blocks,
            num_dst_blocks=num_dst_blocks, book=book,
        )
        if handler.hands_off:  # every job is handed over on its caller's thread: none of its own
            handler._stopped = cast(HandsOffBackend, backend).thread_stopped_reader()
            return handler
        thread = threading.Thread(
            target=handler._issuer_loop, name=f"kvoffload-{direction.value}", daemon=True
        )
        handler._thread = thread
        thread.start()
        return handler

    # -------------------------------------------------------------------------------- properties

    @property
    def path(self) -> str:
        """The transfer path this handler's backend reports."""
        return self._path

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    @property
    def hands_off(self) -> bool:
        """Whether the backend hands each job to a thread of its own (``HandsOffBackend``): the
        worker's fast front submits the jobs of such a handler that books them
        (:meth:`BookedHandler.submit_handed_off`)."""
        return bool(getattr(self._backend, "hands_off", False))

    @property
    def thread_stopped(self) -> bool:
        """True when the issuer thread is not running (it can issue no more copies): the handler's,
        or, for a hands-off backend, the backend's own."""
        if self._stopped is not None:
            return self._stopped()
        return self._thread is None or not self._thread.is_alive()

    # ----------------------------------------------------------------------------------- submit

    def submit(
        self, job_id: int, src_blocks: BlockIds, dst_blocks: BlockIds, *, stream: object = None,
        fence: object = None,
    ) -> None:
        """Validate and submit one job; see :meth:`submit_validated` for what happens after (and
        for ``fence``).

        Raises (before anything is submitted; the handler is unchanged):
            ClosedError: after shutdown.
            JobIdError: a non-int job id, or one already in flight or unreturned.
            BlockIdTypeError, InvalidBlockIdError: malformed ids, unequal lengths, duplicate
                destinations.
            DeviceMismatchError: a stream of another device (or any stream for the host backend).
        """
        self._booked(job_id, src_blocks, dst_blocks,
                     lambda job, src, dst: self.submit_validated(job, src, dst, stream=stream, fence=fence))

    def _booked(self, job_id: int, src_blocks: BlockIds, dst_blocks: BlockIds,
                submit: Callable[[int, I64Array, I64Array], _T]) -> _T:
        """Validate the job id and ids, book the job, then ``submit(job, src, dst)`` (the booking
        forgotten if it raises). Raises as :meth:`submit`, before anything is submitted."""
        self._check_open()
        job = as_job_id(job_id)
        src = as_block_ids("src_blocks", src_blocks, self.num_src_blocks)
        dst = as_block_ids("dst_blocks", dst_blocks, self.num_dst_blocks)
        check_pairs(src, dst, "src_blocks", "dst_blocks")
        self._book.reserve(job, self)
        try:
            return submit(job, src, dst)
        except BaseException:
            self._book.forget(job)
            raise

    def fence(self, stream: object = None) -> object:
        """Capture the compute-stream position later jobs must wait for (see :meth:`submit_validated`).
        The caller owns it and gives it back with :meth:`release_fence`.

        Raises:
            ClosedError: after shutdown.
            DeviceMismatchError: the stream is not one of the backend's device.
        """
        backend = self._open_backend()
        return backend.fence(stream)

    def release_fence(self, fence: object) -> None:
        """Give back a fence from :meth:`fence` once every job submitted with it was issued (see
        :meth:`wait_issued`). Does nothing after shutdown (the backend is gone)."""
        backend = self._backend
        if backend is not None:
            backend.release_fence(fence)

    def submit_validated(
        self, job_id: int, src: I64Array, dst: I64Array, *, stream: object = None,
        fence: object = None,
    ) -> None:
        """Submit a job whose ids the caller already validated and reserved in the book.

        Orders the job after the work queued on ``stream`` (the compute stream) before this call,
        or, when ``fence`` (from :meth:`fence`) is given, after the work queued when it was taken.
        An empty job completes at once with ``ok=True``. A failure to capture the fence (a device
        fault) is reported as the job's failed result, not raised.

        Raises:
            ClosedError: after shutdown.
            DeviceMismatchError: the stream is not one of the backend's device.
        """
        self._enqueue(job_id, src, dst, stream, fence, None)

    def submit_by_layer(
        self, job_id: int, src_blocks: BlockIds, dst_blocks: BlockIds, tables: tuple[PageTable, ...], *,
        stream: object = None,
    ) -> LayerMarks:
        """:meth:`submit` for a job that lands layer after layer (``tables[i]``: layer ``i``'s
        pages): validates the ids, books the job, then :meth:`submit_layered`; returns the marks.
        Raises as :meth:`submit`, before anything is submitted."""
        return self._booked(job_id, src_blocks, dst_blocks,
                            lambda job, src, dst: self.submit_layered(job, src, dst, tables, stream=stream))

    def submit_layered(
        self, job_id: int, src: I64Array, dst: I64Array, tables: tuple[PageTable, ...], *,
        stream: object = None,
    ) -> LayerMarks:
        """:meth:`submit_validated` for a job that lands layer after layer (``tables[i]``: layer
        ``i``'s pages), issued here unless a job is queued for issue; returns the marks, which the
        handler owns until the result is published (docs/design.md §12). Raises as
        :meth:`submit_validated`."""
        backend = self._open_backend()
        issued, size = self._layer_groups(backend, src, tables)
        make = getattr(backend, "layer_marks", None)
        marks: LayerMarks = make(len(issued)) if make is not None else WholeJobMarks(len(issued))
        self._enqueue(job_id, src, dst, stream, None, (self._layer_plans_for(issued), marks))
        return marks if size == 1 else GroupedMarks(marks, size, len(tables))

    def _layer_plans_for(self, tables: tuple[PageTable, ...]) -> tuple[CopyPlan, ...]:
        """The plans of a layered job over ``tables`` (one a layer, or a group of layers), built
        once for each (the layout's layers, and their groups)."""
        cached = self._layer_plans.get(id(tables))
        if cached is None or cached[0] is not tables:
            cached = self._layer_plans[id(tables)] = (tables, tuple(self._plan.for_pages(t) for t in tables))
        return cached[1]

    def _layer_groups(self, backend: Backend, host: I64Array,
                      tables: tuple[PageTable, ...]) -> tuple[tuple[PageTable, ...], int]:
        """What a layered load from host records ``host`` over the layout's ``tables`` is issued
        as: the layers themselves and 1, or their groups and the layers a group holds, where the
        backend moves the load through ``staged`` and its layers' narrow spans would go as a
        descriptor per record (docs/design.md §12, *Narrow layers grouped for staged*). The groups
        are made once per layout; a job of a layout with groups pays for the backend's path and,
        through ``staged``, a sort of its host ids (8-18 us for 256 ids on the CI machine; about 1
        us through another path, 0.4 us for a layout whose layers are wide)."""
        cached = self._groups.get(id(tables))
        if cached is None or cached[0] is not tables:
            size = group_size(tables)
            cached = self._groups[id(tables)] = (tables, size, grouped(tables, size) if size > 1 else tables)
        _, size, groups = cached
        if size == 1 or self.direction is not Direction.LOAD:  # (``host`` is the source of a load)
            return tables, 1
        path_for = getattr(backend, "layered_path_for", None)
        if path_for is None or path_for(host) != "staged":
            return tables, 1
        if not mostly_apart(host, int(getattr(backend, "strided_min_rows", 0))):
            return tables, 1
        return groups, size

    def _enqueue(
        self, job_id: int, src: I64Array, dst: I64Array, stream: object, fence: object,
        layered: tuple[tuple[CopyPlan, ...], LayerMarks] | None,
    ) -> None:
        backend = self._open_backend()
        nbytes = int(src.shape[0]) * self._page_bytes
        owns_fence = fence is None
        hands_off = getattr(backend, "hands_off", False)
        try:
            if fence is None:  # also for an empty job: it checks the stream argument
                fence = cast(HandsOffBackend, backend).position(stream) if hands_off else backend.fence(stream)
        except DeviceMismatchError:
            raise
        except Exception as exc:  # a device fault: the job is reported failed, never dropped
            self._record(self._result(job_id, False, nbytes, 0.0, self._path, exc), layered)
            return
        if src.shape[0] == 0:
            if owns_fence:
                backend.release_fence(fence)
            self._record(self._result(job_id, True, 0, 0.0, _EMPTY_PATH, None), layered)
            return
        transfer = _Transfer(job_id, src, dst, nbytes, fence, owns_fence)
        if layered is not None:
            transfer.layers, transfer.marks = layered
        if hands_off:  # issued here, in submit order (docs/design.md §16): nothing to weigh
            self._hand_over(backend, transfer)
            return
        pairs = int(src.shape[0])
        cost = 0 if layered is not None else backend.issue_cost(self._plan, pairs)
        # (a layered job is issued here whenever it may be: its layers are waited for right away)
        with self._lock:
            self._refuse_if_closed(backend, transfer)
            self._advance()
            idle = not self._fifo  # no job in flight: nothing for this one to overlap with
            here = self._pending == 0 and backend.can_issue_here()
            head = None
            if here and layered is not None and len(layered[0]) > 1 and hasattr(backend, "issue_layers"):
                head = _Transfer(job_id, src, dst, 0, fence, False, head=True, layers=layered[0][:1],
                                 marks=layered[1])  # layer 0 here, the others on the thread
                transfer.layers, transfer.first_layer = layered[0][1:], 1
                self._fifo.append(head)
            elif here and cost > INLINE_ISSUE_MAX_DESCRIPTORS and idle and pairs > 1:
                head = self._split(backend, transfer, pairs)  # see INLINE_HEAD_MAX_DESCRIPTORS
                if head is not None:
                    self._fifo.append(head)
            self._fifo.append(transfer)
            self._submitted += 1
            inline = here and (head is not None or cost <= INLINE_ISSUE_MAX_DESCRIPTORS)
            self._pending += 1 if head is None else 2
            if inline:
                self._issue_lock.acquire()  # taken under _lock: no queued job can overtake this one
            if head is not None:
                self._queue.put(transfer)  # queued now: it is issued right after the head
        if inline:
            try:
                self._issue(backend, head if head is not None else transfer, None)
            finally:
                self._issue_lock.release()
        elif head is None:
            self._queue.put(transfer)

    def stream_handle(self, stream: object = None) -> int:
        """The handle of ``stream`` for :meth:`BookedHandler.submit_handed_off` (None: the device's current
        stream; :meth:`current_stream_reader` reads that without a call of this method).

        Raises:
            ClosedError: after shutdown.
            DeviceMismatchError: the stream is not one of the backend's device.
        """
        return cast(HandsOffBackend, self._open_backend()).stream_handle(stream)

    def current_stream_reader(self) -> Callable[[], int]:
        """The hands-off backend's reader of the calling thread's current stream (a call without
        arguments returning its handle), for :meth:`BookedHandler.submit_handed_off`."""
        backend = self._backend
        assert backend is not None
        return cast(HandsOffBackend, backend).current_stream_reader()

    def early_wake(self) -> tuple[int, Callable[[], object]] | None:
        """The hands-off backend's early wake for this handler's jobs (see
        ``HandsOffBackend.early_wake``), for the worker's fast front: the fewest pairs of a job to
        make the call for, and the call; None when there is none."""
        backend = self._backend
        assert backend is not None
        return cast(HandsOffBackend, backend).early_wake(self._plan.pages.num_pages)

    def _hand_over(self, backend: Backend, transfer: _Transfer) -> None:
        """Queue ``transfer`` and hand it over through :meth:`_issue` on this thread (a hands-off
        backend: cheap).

        One hand-off at a time, in the order the callers take ``_issue_lock``: it is taken before
        ``_lock`` (as the issuer thread takes them), so the queue's order is the hand-offs' order
        and a caller waiting for it holds nothing the hand-off in progress needs (taking it under
        ``_lock`` deadlocked two threads submitting at once: the second held ``_lock`` waiting for
        it while the first waited for ``_lock`` to publish its ticket).
        """
        with self._issue_lock:
            with self._lock:
                self._refuse_if_closed(backend, transfer)
                self._fifo.append(transfer)
                self._submitted += 1
                self._pending += 1
            self._issue(backend, transfer, None)

    def _split(self, backend: Backend, transfer: _Transfer, pairs: int) -> _Transfer | None:
        """Cut the head off a costly job; ``transfer`` keeps the rest, the fence, the byte count.
        None, with ``transfer`` whole, when the backend would move the head or the rest on another
        path than the whole job's (``path_for``, a backend's that chooses by size): a part on another
        stream holds the other behind it, on a path chosen for jobs of its size (an expedited lane's
        10 MiB load had its 5 MiB head go through ``sm``, at about half the link)."""
        count = pairs // 2
        while count > 1 and backend.issue_cost(self._plan, count) > INLINE_HEAD_MAX_DESCRIPTORS:
            count //= 2
        path_for = getattr(backend, "path_for", None)
        if path_for is not None and not path_for(count) == path_for(pairs - count) == path_for(pairs):
            return None
        head = _Transfer(transfer.job_id, transfer.src[:count], transfer.dst[:count],
                         count * self._page_bytes, transfer.fence, False, head=True)
        transfer.src, transfer.dst = transfer.src[count:], transfer.dst[count:]
        return head

    def _issue(self, backend: Backend, transfer: _Transfer, init_error: BaseException | None) -> None:
        """Issue one transfer (the caller holds ``_issue_lock``) and publish its ticket."""
        if init_error is not None:
            transfer.ticket = FailedTicket(init_error)
        elif self._abort.is_set():
            transfer.ticket = FailedTicket(TransferError(_SHUT_DOWN))
        else:
            t = transfer
            try:
                if t.layers is None or t.marks is None or isinstance(t.marks, WholeJobMarks):
                    t.ticket = backend.issue(self._plan, t.src, t.dst, t.fence)
                else:
                    t.ticket = backend.issue_layers(t.layers, t.src, t.dst, t.fence, t.marks,  # type: ignore[attr-defined]
                                                    t.first_layer)
            except Exception as exc:  # reported as the job's failure
                transfer.ticket = FailedTicket(exc)
        marks = transfer.marks
        if isinstance(marks, WholeJobMarks):
            assert transfer.ticket is not None
            marks.attach(transfer.ticket)
        elif marks is not None and not transfer.head:
            marks.settle()  # layers the issue could not mark wait no more
        fence, transfer.fence = transfer.fence, None
        if transfer.owns_fence:
            backend.release_fence(fence)  # no other job waits for it: the wait was enqueued
        self._mark_issued(transfer)

    def _mark_issued(self, transfer: _Transfer) -> None:
        """``transfer`` has its ticket: it is no longer pending (wakes :meth:`wait_issued`)."""
        with self._lock:
            self._pending -= 1
            transfer.issued = True
            if self._issue_waiters:
                self._issued.notify_all()

    def _issuer_loop(self) -> None:
        backend = self._backend
        assert backend is not None
        init_error: BaseException | None = None
        try:
            backend.start_thread()
        except Exception as exc:  # every job this thread would issue fails with it
            init_error = exc
        while True:
            transfer = self._queue.get()
            if transfer is None:
                return
            with self._issue_lock:
                self._issue(backend, transfer, init_error)

    def wait_issued(self, timeout: float) -> bool:
        """Wait until every job submitted so far was issued (so a fence they share may be given
        back); True when they were within ``timeout``."""
        with self._lock:
            pending = [t for t in self._fifo if not t.issued]
            if not pending:
                return True
            return self._wait_issued(pending[-1], timeout)

    # ------------------------------------------------------------------------------ completion

    def poll(self) -> list[TransferResult]:
        """Results of every job finished since the last ``poll``, in completion order (the book's:
        with a shared book, its other sources' too). Never blocks.

        Raises:
            ClosedError: after shutdown.
        """
        self._check_open()
        return self._book.poll()

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[TransferResult]:
        """Wait until the given jobs finished; return their results in the order asked.

        Results of other jobs that finish meanwhile stay for the next ``poll``. Waiting for a job
        also waits for the jobs submitted before it in this direction (they finish in order).

        Raises:
            ClosedError: after shutdown.
            JobIdError, InvalidArgumentError: malformed ids or timeout (before waiting).
            UnknownJobError: an id neither in flight nor finished-and-unreturned.
            WaitTimeoutError: the deadline passed; ``pending`` names the unfinished jobs, which stay
                in flight (the finished ones stay available too).
        """
        self._check_open()
        return self._book.wait(job_ids, timeout)

    def advance(self) -> None:
        """Publish the results of the jobs that finished (the book's call); never blocks."""
        with self._lock:
            self._advance()

    def wait_progress(self, job_id: int, timeout: float) -> None:
        """Wait up to ``timeout`` for the head job to be issued, then to finish (jobs finish in
        order, so ``job_id`` is done no earlier); the book's call, with its deadline."""
        with self._lock:
            head = self._fifo[0] if self._fifo else None
            if head is None:
                return
            if not head.issued:
                self._wait_issued(head, timeout)
                return
        ticket = head.ticket
        assert ticket is not None
        try:
            ticket.wait(timeout)
        except Exception as exc:  # _advance fails the job with it (a waiter looked again at once)
            with self._lock:
                if head.wait_failure is None:
                    head.wait_failure = exc

    def _wait_issued(self, transfer: _Transfer, timeout: float) -> bool:
        """Wait (holding the lock, which the wait releases) until ``transfer`` was issued; True
        when it was within ``timeout``."""
        self._issue_waiters += 1
        try:
            return self._issued.wait_for(lambda: transfer.issued, timeout)
        finally:
            self._issue_waiters -= 1

    def _advance(self) -> None:
        """Pop finished transfers from the head (caller holds the lock; never blocks)."""
        while self._fifo:
            head = self._fifo[0]
            if not head.issued:
                return
            ticket = head.ticket
            assert ticket is not None
            try:
                if head.wait_failure is not None:
                    raise head.wait_failure
                if not ticket.done():
                    return
            except Exception as exc:  # completion failed: the job fails, the queue moves on
                self._fifo.popleft()
                if head.marks is not None and not head.head:
                    head.marks.release()
                self._complete(head, self._result(head.job_id, False, head.nbytes, 0.0, self._path, exc))
                continue
            self._fifo.popleft()
            self._complete(head, self._finished(head, ticket))

    def _complete(self, transfer: _Transfer, result: TransferResult) -> None:
        """Publish a popped transfer's result (caller holds the lock) — or, for the head part of a
        split job, hand it to the rest, next in the FIFO, whose result then covers both."""
        if transfer.head:
            self._fifo[0].carried = result
            return
        first = transfer.carried
        if first is not None:
            result = attrs.evolve(
                result, ok=result.ok and first.ok, seconds=result.seconds + first.seconds,
                error=first.error if first.error is not None else result.error,
            )
        self._record_locked(result)

    def _finished(self, transfer: _Transfer, ticket: Ticket) -> TransferResult:
        """The result of a completed transfer; its ticket's events go back to their pool."""
        error = ticket.error
        try:
            seconds = ticket.seconds()
        except Exception as exc:  # timing is advisory; a failed read must not fail the job
            _log.debug("could not read job %d's copy time: %s", transfer.job_id, exc)
            seconds = 0.0
        ticket.release()
        if transfer.marks is not None and not transfer.head:
            transfer.marks.release()
        path = ticket.path or self._path
        return self._result(transfer.job_id, error is None, transfer.nbytes, seconds, path, error)

    def _result(
        self, job_id: int, ok: bool, nbytes: int, seconds: float, path: str, error: BaseException | None
    ) -> TransferResult:
        return TransferResult(
            job_id=job_id, direction=self.direction, ok=ok, nbytes=nbytes, seconds=seconds,
            path=path, error=error,
        )

    def _record(
        self, result: TransferResult, layered: tuple[tuple[CopyPlan, ...], LayerMarks] | None = None,
    ) -> None:
        """Record the result of a job that finished at submit (empty, or failed to fence); its
        layers, if any, have nothing to wait for."""
        if layered is not None:
            layered[1].release()
        with self._lock:
            self._submitted += 1
            self._record_locked(result)

    def _record_locked(self, result: TransferResult) -> None:
        if result.ok:
            self._completed += 1
            self._bytes_done += result.nbytes
            self._busy_s += result.seconds
        else:
            self._failed += 1
        self._book.finish(result.job_id, result)

    def driver_call_stats(self) -> DriverCallStats | None:
        """Where callers waited inside the driver behind this handler's backend, where the backend
        counts it (the native issuer: :class:`~kvoffload.records.DriverCallStats`), else None.

        Raises:
            ClosedError: after shutdown.
            TransferError: a shutdown released the backend meanwhile.
        """
        self._check_open()
        backend = self._backend
        return backend.call_stats() if isinstance(backend, CallStatsSource) else None

    def stats(self) -> HandlerStats:
        """Counters since creation (also valid after shutdown)."""
        with self._lock:
            return HandlerStats(
                direction=self.direction,
                submitted=self._submitted,
                completed=self._completed,
                failed=self._failed,
                in_flight=sum(not t.head for t in self._fifo),
                bytes_done=self._bytes_done,
                busy_seconds=self._busy_s,
            )

    # ---------------------------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Drain and release, with the contract of the module docstring. Idempotent.

        Raises:
            InvalidArgumentError: a malformed timeout (nothing is done then).
            Exception: the drain's kept error, after everything was released; several failures come
                as one :class:`ShutdownError`.
        """
        seconds = as_timeout(timeout)
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + seconds
        kept: BaseException | None = None
        try:
            self._drain(deadline)
        except Exception as exc:
            _log.error("%s handler: drain failed, abandoning in-flight jobs: %s", self.direction.value, exc)
            kept = exc
            self._abort.set()
            with self._lock:
                self._abandon_locked()
        finally:
            failures = self._release(deadline)
        if kept is not None and not failures:
            raise kept
        if kept is not None or len(failures) > 1:
            raise ShutdownError(
                f"{self.direction.value} handler shutdown failed",
                ([kept] if kept is not None else []) + failures,
            )
        if failures:
            raise failures[0]

    def _drain(self, deadline: float) -> None:
        while True:
            with self._lock:
                head = self._fifo[0] if self._fifo else None
            if head is None:
                return
            with self._lock:
                issued = self._wait_issued(head, max(0.0, deadline - time.monotonic()))
            if not issued:
                raise WaitTimeoutError(
                    f"{self.direction.value} job {head.job_id} was not issued before the shutdown "
                    "deadline", pending=[head.job_id],
                )
            ticket = head.ticket
            assert ticket is not None
            if not ticket.wait(max(0.0, deadline - time.monotonic())):
                raise WaitTimeoutError(
                    f"{self.direction.value} job {head.job_id} did not finish before the shutdown "
                    "deadline", pending=[head.job_id],
                )
            with self._lock:
                if self._fifo and self._fifo[0] is head:  # a concurrent advance may have popped it
                    self._fifo.popleft()
                    self._complete(head, self._finished(head, ticket))

    def _abandon_locked(self) -> None:
        """A failed drain's: keep what the jobs still in flight hold for the rest of the process
        (caller holds the lock)."""
        _ABANDONED.extend(self._fifo)
        self._fifo.clear()

    def _release(self, deadline: float) -> list[BaseException]:
        """Stop the issuer thread and release the backend; never raises, returns the failures."""
        failures: list[BaseException] = []
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                if isinstance(backend, ReleasedWithin):
                    backend.release_within(max(ISSUER_JOIN_MIN_S, deadline - time.monotonic()))
                else:
                    backend.release()
            except Exception as exc:
                failures.append(exc)
        self._queue.put(None)
        thread = self._thread
        if thread is not None:
            thread.join(max(ISSUER_JOIN_MIN_S, deadline - time.monotonic()))
            if thread.is_alive():
                failures.append(
                    WaitTimeoutError(
                        f"the {self.direction.value} issuer thread did not stop before the deadline "
                        "(a copy may still be in progress)"
                    )
                )
        if self._owns_book:
            self._book.clear()
        return failures

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the {self.direction.value} handler was shut down")

    def _refuse_if_closed(self, backend: Backend, transfer: _Transfer) -> None:
        """Under ``_lock``, before ``transfer`` is queued: a shutdown that began after the submit's
        first look may have drained and released everything already, so the job is refused, its
        fence and marks given back.

        Raises:
            ClosedError: after shutdown.
        """
        if self._closed:
            if transfer.owns_fence:
                backend.release_fence(transfer.fence)
            if transfer.marks is not None:
                transfer.marks.release()
            self._check_open()

    def _open_backend(self) -> Backend:
        """The backend of an open handler (a shutdown meanwhile may have released it).

        Raises:
            ClosedError: after shutdown.
        """
        self._check_open()
        backend = self._backend
        if backend is None:  # released by a shutdown that began after the check above
            raise ClosedError(f"the {self.direction.value} handler was shut down")
        return backend


class BookedHandler(DirectionHandler):
    """A :class:`DirectionHandler` over a backend that keeps its jobs in a book of its own
    (:class:`BookingBackend`, the native issuer's library; docs/design.md §16).

    Owns: what the base class owns but its FIFO (empty here) and, for each layered job not yet
    published, its marks. Every job of the direction is handed over booked, on the caller's thread
    and in submit order (the library appends it to the book under its lock), with no object, lock
    or queue entry of the handler's per job; a job that fails before the hand-off is booked failed,
    in its place. ``advance`` takes every finished job's result from the head of the book in hand-off
    order in one call and publishes them; a wait waits in the library for the first job not done
    among the job and those handed over before it. The
    shutdown contract is the base class's: drain (wait for the book's last job, with the deadline,
    then take its results), else abandon (the library gives up what is in flight once its thread
    stops), then release the backend, which frees the book.
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._marks: dict[int, LayerMarks] = {}  # a layered job's, until its result is published
        self._booked_call: Callable[..., int] | None = None
        # the fast front's layered hand-offs: per table set (the layout's layers, their groups),
        # by id, the tables and the bound call
        self._booked_layered: dict[int, tuple[tuple[PageTable, ...], Callable[..., int]]] = {}
        # The book keys jobs by 64-bit ints: a job id outside that range (or one equal to a key in
        # use for such an id) is booked under a key of its own, unused by any job in flight.
        self._synthetic: dict[int, int] = {}  # key -> job id
        self._keys: dict[int, int] = {}  # job id -> key
        self._next_key = itertools.count(_KEY_MIN)
        self._book_total = 0  # jobs ever booked, kept when the backend goes

    def _key(self, job_id: int) -> int:
        """The book's key of job ``job_id`` (reserved in the job book), made when it needs one.

        A key is entered before the job book is asked whether a job in flight has it as its id: a
        job reserved with that id after the look finds the key taken and gets a key of its own."""
        if _KEY_MIN <= job_id < _KEY_END and job_id not in self._synthetic and job_id not in self._keys:
            return job_id
        with self._lock:
            made = self._keys.get(job_id)
            if made is not None:
                return made
            while True:
                key = next(self._next_key)
                if key in self._synthetic:
                    continue
                self._synthetic[key] = job_id
                if not self._book.known(key):
                    break
                del self._synthetic[key]
            self._keys[job_id] = key
        return key

    def _job_of(self, key: int) -> int:
        """The job id a taken result's ``key`` stands for (its key let go; caller holds the lock)."""
        job_id = self._synthetic.pop(key, None)
        if job_id is None:
            return key
        del self._keys[job_id]
        return job_id

    def _booking(self) -> BookingBackend:
        """The backend of an open handler.

        Raises:
            ClosedError: after shutdown.
        """
        return cast(BookingBackend, self._open_backend())

    def _refused(self, job_id: int, pairs: int, error: BaseException, marks: LayerMarks | None) -> None:
        """A job the backend did not book (it failed with ``error`` before it was handed over): its
        failure is published now, or, when a shutdown released the backend meanwhile, refused.

        Raises:
            ClosedError: after shutdown.
        """
        if marks is not None:
            self._marks.pop(job_id, None)
            marks.release()
        key = self._keys.get(job_id)
        if key is not None:  # not booked: its key goes
            with self._lock:
                self._job_of(key)
        self._check_open()
        self._record(self._result(job_id, False, pairs * self._page_bytes, 0.0, self._path, error))

    def _failed_hand_off(self, job_id: int, pairs: int, error: BaseException,
                         marks: LayerMarks | None) -> None:
        """A hand-off raised ``error``: the job is booked failed with it, in its place (else, the
        backend released, refused as :meth:`_refused`)."""
        backend = self._backend
        if backend is None or not cast(BookingBackend, backend).book_fail(self._key(job_id), pairs, error):
            self._refused(job_id, pairs, error, marks)

    def submit_handed_off(self, job_id: int, src: I64Array, dst: I64Array, stream: int) -> None:
        """The worker's fast front's submit (docs/design.md §16): a non-empty whole job, its ids
        validated and booked, ordered after the work queued on ``stream`` (a handle from
        :meth:`stream_handle` or :meth:`current_stream_reader`) before this call, handed over on
        this thread in submit order with its fence recorded in the same call into the library: one
        call. A failure to hand it over is the job's failed result.

        Raises:
            ClosedError: after shutdown.
        """
        if self._closed:
            self._check_open()
        call = self._booked_call
        if call is None:
            call = self._booked_call = self._booking().booked_hand_off_call((self._plan,), whole=True)
        # (the common case of _key inline: the fast front makes this call for every job)
        key = (job_id if _KEY_MIN <= job_id < _KEY_END and not self._synthetic and not self._keys
               else self._key(job_id))
        try:
            code = call(key, src, dst, stream)
        except Exception as exc:  # noqa: BLE001 - it never should: the job's failed result, in order
            self._failed_hand_off(job_id, int(src.shape[0]), exc, None)
            return
        if code:
            self._refused(job_id, int(src.shape[0]), self._booking().book_error(code), None)

    def submit_handed_off_layered(
        self, job_id: int, src: I64Array, dst: I64Array, stream: int, tables: tuple[PageTable, ...],
    ) -> LayerMarks:
        """:meth:`submit_handed_off` for a job that lands layer after layer (``tables[i]``: layer
        ``i``'s pages), as :meth:`submit_layered` submits one; returns the marks, which the handler
        owns until the result is published (docs/design.md §12; a job issued as groups of layers
        returns them as its layers, :class:`~kvoffload._layer_groups.GroupedMarks`).

        Raises:
            ClosedError: after shutdown.
        """
        backend = self._booking()
        issued, size = self._layer_groups(backend, src, tables)
        cached = self._booked_layered.get(id(issued))
        if cached is None or cached[0] is not issued:
            plans = self._layer_plans_for(issued)
            cached = self._booked_layered[id(issued)] = (issued, backend.booked_hand_off_call(plans, whole=False))
        call = cached[1]
        marks = backend.layer_marks(len(issued))
        shown: LayerMarks = marks if size == 1 else GroupedMarks(marks, size, len(tables))
        self._marks[job_id] = marks  # before the hand-off: its result may be taken at once
        key = (job_id if _KEY_MIN <= job_id < _KEY_END and not self._synthetic and not self._keys
               else self._key(job_id))  # (as submit_handed_off's: before layer 0's issue)
        try:
            code = call(key, src, dst, stream, marks)
        except Exception as exc:  # noqa: BLE001 - it never should: the job's failed result, in order
            marks.settle()
            self._failed_hand_off(job_id, int(src.shape[0]), exc, marks)
            return shown
        marks.settle()  # layers the hand-off could not mark wait no more
        if code:
            self._refused(job_id, int(src.shape[0]), backend.book_error(code), marks)
        return shown

    def _hand_over(self, backend: Backend, transfer: _Transfer) -> None:
        """The validating path's hand-off (:meth:`DirectionHandler._enqueue`), booked."""
        with self._lock:
            self._refuse_if_closed(backend, transfer)
        booking = cast(BookingBackend, backend)
        marks = transfer.marks
        if marks is not None:
            self._marks[transfer.job_id] = marks
        pairs = int(transfer.src.shape[0])
        key = self._key(transfer.job_id)
        failed: BaseException | None = None  # before its hand-off: booked failed, in its place
        refused: BaseException | None = None  # not booked: published now
        if self._abort.is_set():
            failed = TransferError(_SHUT_DOWN)
        else:
            plans = transfer.layers if transfer.layers is not None else (self._plan,)
            try:
                code = booking.issue_booked(key, plans, transfer.src, transfer.dst,
                                            transfer.fence, marks, transfer.first_layer)
            except Exception as exc:  # noqa: BLE001 - it never should: the job's failed result, in order
                failed = exc
            else:
                refused = booking.book_error(code) if code else None
        if failed is not None and not booking.book_fail(key, pairs, failed):
            refused = failed
        if marks is not None:
            marks.settle()
        if transfer.owns_fence:
            backend.release_fence(transfer.fence)
        if refused is not None:
            self._refused(transfer.job_id, pairs, refused, marks)

    def wait_issued(self, timeout: float) -> bool:
        """Always: a booked job was issued (handed over) before its submit returned."""
        return True

    def advance(self) -> None:
        """Publish the results of the jobs at the head of the book that finished, in order."""
        with self._lock:
            self._take_locked()

    def _take_locked(self) -> BaseException | None:
        """Publish the finished results the book has (caller holds the lock); the first error of a
        job that failed in its completion, if one did (a drain's failure, as a ticket's wait that
        raises fails the base class's drain)."""
        backend = self._backend
        if backend is None:
            return None
        failure: BaseException | None = None
        for outcome in cast(BookingBackend, backend).book_take():
            if outcome.completion and failure is None:
                failure = outcome.error
            job_id = self._job_of(outcome.job_id)
            marks = self._marks.pop(job_id, None)
            if marks is not None:
                marks.release()
            self._record_locked(self._result(
                job_id, outcome.ok, outcome.pairs * self._page_bytes, outcome.seconds,
                outcome.path or self._path, outcome.error))
        return failure

    def wait_progress(self, job_id: int, timeout: float) -> None:
        """Wait in the library, up to ``timeout``, for ``job_id`` to finish."""
        key = self._keys.get(job_id)
        if key is None:
            if not _KEY_MIN <= job_id < _KEY_END or job_id in self._synthetic:
                return  # its key went with its result (taken meanwhile): nothing to wait for
            key = job_id
        backend = self._backend
        if backend is not None:
            cast(BookingBackend, backend).book_wait(key, timeout)

    def stats(self) -> HandlerStats:
        """Counters since creation (also valid after shutdown)."""
        with self._lock:
            backend = self._backend
            booked, _, total = (cast(BookingBackend, backend).book_count() if backend is not None
                                else (0, None, self._book_total))
            return HandlerStats(
                direction=self.direction, submitted=self._submitted + total,
                completed=self._completed, failed=self._failed, in_flight=booked,
                bytes_done=self._bytes_done, busy_seconds=self._busy_s,
            )

    def _drain(self, deadline: float) -> None:
        backend = self._backend
        if backend is not None:  # a hand-off that passed the closed check before the shutdown
            cast(BookingBackend, backend).close_book(  # is booked now, or refused from here on
                max(0.0, deadline - time.monotonic()))
        while True:
            with self._lock:
                failure = self._take_locked()
            if failure is not None:
                raise failure
            backend = self._backend
            if backend is None:
                return
            booking = cast(BookingBackend, backend)
            count, head, _ = booking.book_count()
            if not count:
                return
            if not booking.book_wait(None, max(0.0, deadline - time.monotonic())):
                raise WaitTimeoutError(
                    f"{self.direction.value} job {head} did not finish before the shutdown "
                    "deadline", pending=[head] if head is not None else [],
                )

    def _release(self, deadline: float) -> list[BaseException]:
        """As the base class's, the count of jobs ever booked kept (the issuer goes)."""
        backend = self._backend
        if backend is not None:
            self._book_total = cast(BookingBackend, backend).book_count()[2]
        return super()._release(deadline)

    def _abandon_locked(self) -> None:
        """A failed drain's: the library gives up the book's jobs in flight as its thread stops;
        their marks are kept for the rest of the process."""
        _ABANDONED.extend(self._marks.values())
        self._marks.clear()
