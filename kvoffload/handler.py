"""DirectionHandler: one direction's jobs, from submit to result.

Owns: its backend (copy streams and events, or the host copy), the FIFO of in-flight transfers, and
one issuer thread. Borrows: the copy plan's addresses (the device tensors and the host records
belong to the layout and the region; the worker keeps them alive for longer than this handler) and
its job book (:class:`~kvoffload._jobs.JobBook`: its own, or the worker's shared one), where it
publishes results.

``submit`` validates everything before touching the device, captures the compute-stream fence in the
caller's thread (so the job waits for the work queued before the call), appends the transfer to the
FIFO and hands it to the issuer thread, which builds the descriptors and enqueues the copies (the
driver's per-page cost is paid there, with the GIL released in the driver). A job cheap to issue
(:data:`INLINE_ISSUE_MAX_DESCRIPTORS`) is issued on the caller's thread when nothing else is queued;
a costlier one with nothing in flight, and a layered load's layer 0, are issued there as a *head*
and the rest on the issuer thread: the link starts at once, the caller pays for one chunk or layer,
and the head's result rides with the rest's (the job still completes as a whole). A backend whose
``hands_off`` is true (the native issuer, docs/design.md §16) only hands a job to a thread of its
own: every job is issued whole on the caller's thread, never split.

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
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Final, Protocol, cast, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload._descriptors import CopyPlan, PageTable
from kvoffload._jobs import FailedTicket, JobBook, Ticket, as_job_id, as_timeout
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

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT_S", "Backend", "DirectionHandler", "LayeredBackend", "Ticket"]

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
    submit order, never splits one, and takes its own fences with :meth:`position`; the worker's
    fast front hands a whole job over with :meth:`hand_off_call`'s call, its fence recorded on a
    stream in the same call."""

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

    def hand_off_call(self, plan: CopyPlan) -> Callable[[I64Array, I64Array, int], Ticket]:
        """A call ``(src, dst, stream)`` that hands a whole job of ``plan`` over with its fence
        recorded on ``stream`` in the same call; the call never raises (a failure is the
        ticket's)."""

    def hand_off_layers_call(
        self, plans: tuple[CopyPlan, ...],
    ) -> Callable[[I64Array, I64Array, int, LayerMarks], Ticket]:
        """A call ``(src, dst, stream, marks)`` that hands a layered job of ``plans`` (layer ``i``'s
        plan ``plans[i]``) over as :meth:`hand_off_call`'s call hands a whole one, ``marks`` (of
        ``layer_marks``) attached to the job; the call never raises."""

    def layer_marks(self, count: int) -> LayerMarks:
        """Marks for a layered job of ``count`` layers."""

    def early_wake(self, pages: int) -> tuple[int, Callable[[], object]] | None:
        """For jobs of ``pages`` pages per pair: the fewest pairs of a job whose thread is best
        woken as soon as the job is taken, and the call that wakes it (None: never)."""


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
        self._closed = False
        self._submitted = 0
        self._completed = 0
        self._failed = 0
        self._bytes_done = 0
        self._busy_s = 0.0
        self._layer_plans: tuple[tuple[PageTable, ...], tuple[CopyPlan, ...]] | None = None
        # The hands-off backend's call for the fast front's jobs (submit_handed_off), made at its
        # first job.
        self._hand_off_call: Callable[[I64Array, I64Array, int], Ticket] | None = None
        # The fast front's layered hand-off: the layout's tables, their plans, the bound call.
        self._layered_hand_off: tuple[tuple[PageTable, ...], tuple[CopyPlan, ...],
                                      Callable[[I64Array, I64Array, int, LayerMarks], Ticket]] | None = None

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
        handler = cls(
            direction=direction, plan=plan, backend=backend, num_src_blocks=num_src_blocks,
            num_dst_blocks=num_dst_blocks, book=book,
        )
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
        worker's fast front submits such a handler's jobs (:meth:`submit_handed_off`)."""
        return bool(getattr(self._backend, "hands_off", False))

    @property
    def thread_stopped(self) -> bool:
        """True when the issuer thread is not running (it can issue no more copies)."""
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
        self._check_open()
        job = as_job_id(job_id)
        src = as_block_ids("src_blocks", src_blocks, self.num_src_blocks)
        dst = as_block_ids("dst_blocks", dst_blocks, self.num_dst_blocks)
        check_pairs(src, dst, "src_blocks", "dst_blocks")
        self._book.reserve(job, self)
        try:
            self.submit_validated(job, src, dst, stream=stream, fence=fence)
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

    def submit_layered(
        self, job_id: int, src: I64Array, dst: I64Array, tables: tuple[PageTable, ...], *,
        stream: object = None,
    ) -> LayerMarks:
        """:meth:`submit_validated` for a job that lands layer after layer (``tables[i]``: layer
        ``i``'s pages), issued here unless a job is queued for issue; returns the marks, which the
        handler owns until the result is published (docs/design.md §12). Raises as
        :meth:`submit_validated`."""
        backend = self._open_backend()
        make = getattr(backend, "layer_marks", None)
        marks: LayerMarks = make(len(tables)) if make is not None else WholeJobMarks(len(tables))
        self._enqueue(job_id, src, dst, stream, None, (self._layer_plans_for(tables), marks))
        return marks

    def _layer_plans_for(self, tables: tuple[PageTable, ...]) -> tuple[CopyPlan, ...]:
        """The plans of a layered job over ``tables`` (one a layer), built once for the layout's."""
        cached = self._layer_plans
        if cached is None or cached[0] is not tables:
            cached = self._layer_plans = (tables, tuple(self._plan.for_pages(t) for t in tables))
        return cached[1]

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
        """The handle of ``stream`` for :meth:`submit_handed_off` (None: the device's current
        stream; :meth:`current_stream_reader` reads that without a call of this method).

        Raises:
            ClosedError: after shutdown.
            DeviceMismatchError: the stream is not one of the backend's device.
        """
        return cast(HandsOffBackend, self._open_backend()).stream_handle(stream)

    def current_stream_reader(self) -> Callable[[], int]:
        """The hands-off backend's reader of the calling thread's current stream (a call without
        arguments returning its handle), for :meth:`submit_handed_off`."""
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

    def submit_handed_off(self, job_id: int, src: I64Array, dst: I64Array, stream: int) -> None:
        """The worker's fast front's submit (docs/design.md §16): a non-empty whole job of a
        hands-off backend, its ids validated and booked, ordered after the work queued on
        ``stream`` (a handle from :meth:`stream_handle` or :meth:`current_stream_reader`) before
        this call. Handed over on this thread in submit order, as :meth:`_hand_over` hands a job
        over (its steps inline: this runs on the engine's thread for every such job), with the
        fence recorded in the same call into the backend; a failure to hand it over is the job's
        failed result.

        Raises:
            ClosedError: after shutdown.
        """
        hand_off = self._hand_off_call
        if hand_off is None:  # (a shutdown since the worker's look may have released the backend)
            backend = cast(HandsOffBackend, self._open_backend())
            hand_off = self._hand_off_call = backend.hand_off_call(self._plan)
        transfer = _Transfer(job_id, src, dst, src.shape[0] * self._page_bytes, None, False)
        with self._issue_lock:  # as _hand_over's
            self._queue_handed_off(transfer)
            try:
                transfer.ticket = (FailedTicket(TransferError(_SHUT_DOWN)) if self._abort.is_set()
                                   else hand_off(src, dst, stream))
            except Exception as exc:  # reported as the job's failure, as _issue's
                transfer.ticket = FailedTicket(exc)
            self._mark_issued(transfer)

    def submit_handed_off_layered(
        self, job_id: int, src: I64Array, dst: I64Array, stream: int, tables: tuple[PageTable, ...],
    ) -> LayerMarks:
        """:meth:`submit_handed_off` for a job that lands layer after layer (``tables[i]``: layer
        ``i``'s pages), as :meth:`submit_layered` submits one; returns the marks, which the handler
        owns until the result is published (docs/design.md §12).

        Raises:
            ClosedError: after shutdown.
        """
        backend = cast(HandsOffBackend, self._open_backend())  # a shutdown since the worker's look
        cached = self._layered_hand_off
        if cached is None or cached[0] is not tables:
            plans = self._layer_plans_for(tables)
            cached = self._layered_hand_off = (tables, plans, backend.hand_off_layers_call(plans))
        _, plans, hand_off = cached
        marks = backend.layer_marks(len(tables))
        transfer = _Transfer(job_id, src, dst, src.shape[0] * self._page_bytes, None, False,
                             layers=plans, marks=marks)
        with self._issue_lock:  # as _hand_over's
            self._queue_handed_off(transfer)
            try:
                transfer.ticket = (FailedTicket(TransferError(_SHUT_DOWN)) if self._abort.is_set()
                                   else hand_off(src, dst, stream, marks))
            except Exception as exc:  # reported as the job's failure, as _issue's
                transfer.ticket = FailedTicket(exc)
            marks.settle()  # layers the hand-off could not mark wait no more
            self._mark_issued(transfer)
        return marks

    def _queue_handed_off(self, transfer: _Transfer) -> None:
        """Queue a transfer the caller hands over next (the caller holds ``_issue_lock``).

        Raises:
            ClosedError: after shutdown (nothing queued).
        """
        with self._lock:
            self._check_open()
            self._fifo.append(transfer)
            self._submitted += 1
            self._pending += 1

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

    def _split(self, backend: Backend, transfer: _Transfer, pairs: int) -> _Transfer:
        """Cut the head off a costly job; ``transfer`` keeps the rest, the fence, the byte count."""
        count = pairs // 2
        while count > 1 and backend.issue_cost(self._plan, count) > INLINE_HEAD_MAX_DESCRIPTORS:
            count //= 2
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
                _ABANDONED.extend(self._fifo)
                self._fifo.clear()
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
