"""Layer-by-layer loads: the caller's handle (:class:`LayerLoad`) and where a job's layers stand.

A layered load issues its layers in order, 0 first, and *marks* each layer once its copies are
enqueued (docs/design.md §12). :class:`LayerMarks` is the seam: a backend's marks make a stream wait
for a marked layer on the device (the CUDA backend: one pooled event per layer), or block the caller
until the layer was copied (the host backend, whose copies run on its issuer thread: on the CPU the
caller's program order is the compute order). A backend that cannot mark layers gets
:class:`WholeJobMarks`: every layer waits for the whole job, on the host.

Owns nothing itself: a :class:`LayerLoad` borrows its job's marks, which the handler owns and
releases once the job's result was published (a wait on released marks returns at once: the job,
every layer included, has finished). Marks only order; whether the job succeeded comes with its
result through ``poll``/``wait``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

from kvoffload._seconds import WAIT_SLICE_S, as_timeout
from kvoffload.errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    InvalidArgumentError,
    WaitTimeoutError,
)

__all__ = [
    "LAYER_WAIT_TIMEOUT_S",
    "HostLayerMarks",
    "LayerLoad",
    "LayerMarks",
    "WholeJobMarks",
]

#: How long ``wait_layer`` waits by default for a layer to be handed to the device (CUDA: at once
#: unless earlier jobs were still being issued) or copied (host backend).
LAYER_WAIT_TIMEOUT_S: Final = 60.0


class LayerMarks(Protocol):
    """Where a layered job's layers stand (see the module docstring)."""

    @property
    def count(self) -> int:
        """Layers of the job."""

    @property
    def on_device(self) -> bool:
        """Whether :meth:`wait` orders the stream on the device and returns without waiting for
        the copies (False: it waits on the host)."""

    def wait(self, layer: int, stream: object | None, timeout_s: float) -> bool:
        """Order ``stream`` after layer ``layer`` of the job (on the device where the backend has
        one; on the host otherwise), waiting at most ``timeout_s`` on the host for the layer to be
        marked. True when the layer landed (or ``stream`` is ordered after it, or the job's result
        was published); False when the job ended without it (an issue that failed or was given
        up: nothing more will land).

        Raises:
            DeviceMismatchError: a stream the backend does not take.
            WaitTimeoutError: the layer was not marked within ``timeout_s``.
        """

    def settle(self) -> None:
        """No more layers will be marked (the issue returned): waits for unmarked layers return."""

    def release(self) -> None:
        """Give back what the marks hold; waits return at once afterwards. Idempotent."""


class _Waitable(Protocol):
    def wait(self, timeout_s: float) -> bool: ...


class HostLayerMarks:
    """Marks of a job copied on the host: layer ``i`` has landed once :meth:`mark` said so."""

    on_device = False

    def __init__(self, count: int) -> None:
        self._count = count
        self._landed = 0
        self._short: int | None = None  # the first layer never copied, once settled short of all
        self._cond = threading.Condition()

    @property
    def count(self) -> int:
        """Layers of the job."""
        return self._count

    def mark(self, layer: int) -> None:
        """Layers up to ``layer`` were copied."""
        with self._cond:
            self._landed = max(self._landed, layer + 1)
            self._cond.notify_all()

    def settle(self) -> None:
        """Nothing more will be copied: every wait returns (for a layer not copied, False)."""
        with self._cond:
            if self._landed < self._count and self._short is None:
                self._short = self._landed
            self._landed = self._count
            self._cond.notify_all()

    def release(self) -> None:
        """As :meth:`settle`."""
        self.settle()

    def wait(self, layer: int, stream: object | None, timeout_s: float) -> bool:
        """Block until layer ``layer`` was copied (``stream`` must be None: the host has no
        streams); False when the job ended without copying it."""
        if stream is not None:
            raise DeviceMismatchError(
                f"the host backend takes no stream (got {type(stream).__name__}): CPU tensors have "
                "no compute stream to order"
            )
        with self._cond:
            if not self._cond.wait_for(lambda: self._landed > layer, timeout_s):
                raise WaitTimeoutError(f"layer {layer} did not land within {timeout_s} s")
            return self._short is None or layer < self._short


class WholeJobMarks:
    """Marks of a backend that cannot mark layers: every layer waits, on the host, for the whole
    job's ticket. Borrows the ticket (the handler owns it)."""

    on_device = False

    def __init__(self, count: int) -> None:
        self._count = count
        self._ticket: _Waitable | None = None
        self._released = False
        self._cond = threading.Condition()

    @property
    def count(self) -> int:
        """Layers of the job."""
        return self._count

    def attach(self, ticket: _Waitable) -> None:
        """The job was issued: waits go to its ticket."""
        with self._cond:
            self._ticket = ticket
            self._cond.notify_all()

    def settle(self) -> None:
        """Nothing to do: :meth:`attach` comes with the ticket."""

    def release(self) -> None:
        """The job's result was published: waits return at once."""
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def wait(self, layer: int, stream: object | None, timeout_s: float) -> bool:
        """Block until the whole job finished (any stream is then ordered after it); False when
        it failed."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if not self._cond.wait_for(lambda: self._ticket is not None or self._released, timeout_s):
                raise WaitTimeoutError(f"layer {layer}: the job was not issued within {timeout_s} s")
            ticket, released = self._ticket, self._released
        if released or ticket is None:
            return True
        try:
            finished = ticket.wait(max(0.0, deadline - time.monotonic()))
        except Exception:  # the job failed: its result says so, and nothing more will land
            return False
        if not finished:
            raise WaitTimeoutError(f"layer {layer}: the job did not finish within {timeout_s} s")
        return True


class LayerLoad:
    """The handle of one layer-by-layer load (``Worker.load_by_layer``).

    ``wait_layer(i)`` orders a stream after layer ``i``'s pages of this job have landed; the job's
    result still comes through ``poll``/``wait`` as a whole. Borrows the job's marks (the worker
    owns them until the job's result was published; waits afterwards return at once). Thread-safe.
    """

    def __init__(self, job_id: int, marks: LayerMarks, check_open: Callable[[], None]) -> None:
        self.job_id = job_id
        self._marks = marks
        self._check_open = check_open

    @property
    def num_layers(self) -> int:
        """Layers of the load (the layout's ``num_layers``)."""
        return self._marks.count

    @property
    def on_device(self) -> bool:
        """Whether :meth:`wait_layer` orders the stream on the device and returns without waiting
        for the copies (the CUDA backend), or waits on the host until the layer landed (the host
        backend) or the whole job finished (a backend that cannot mark layers). Marks of a backend
        written before the attribute, which do not say, count as waiting on the host."""
        return bool(getattr(self._marks, "on_device", False))

    def wait_layer(self, layer: int, stream: object = None, *, timeout: float = LAYER_WAIT_TIMEOUT_S) -> None:
        """Make ``stream`` (default: the device's current stream) wait until layer ``layer``'s pages
        of this job have landed.

        On the CUDA backend the wait is enqueued on the stream and the call returns at once: the
        host never waits for the copies (it waits, up to ``timeout``, only if the job was still
        queued behind earlier jobs for issue). On the host backend (no streams: ``stream`` must be
        None) the call returns once the layer was copied. Layers may be waited for in any order,
        and again. After the job's result was returned the call does nothing (everything landed).
        A failed job's layers hold undefined bytes: its result says so. A wait longer than
        :data:`~kvoffload._seconds.WAIT_SLICE_S` looks at the worker again every slice, so that a
        shutdown meanwhile (which may give the job up) ends it with ``ClosedError``, and so does a
        wait that a shutdown ended by giving the job up before the layer landed (a layer that
        landed returns, a shutdown meanwhile or not).

        Raises (before anything is enqueued):
            ClosedError: the worker was shut down (before the call, or while it waited).
            ArgumentTypeError: ``layer`` not an int, or ``timeout`` not a number.
            InvalidArgumentError: ``layer`` out of range, or ``timeout`` negative or not finite.
            DeviceMismatchError: a stream of another device (any stream on the host backend).
            WaitTimeoutError: the layer was not handed to the device (CUDA) or copied (host) within
                ``timeout``.
        """
        self._check_open()
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ArgumentTypeError(f"layer = {layer!r} must be an int, not a {type(layer).__name__}")
        count = self._marks.count
        if not 0 <= layer < count:
            raise InvalidArgumentError(
                f"layer = {layer} is out of range: job {self.job_id} loads {count} layers (0..{count - 1})"
            )
        seconds = as_timeout(timeout)
        if seconds <= WAIT_SLICE_S:
            if not self._marks.wait(layer, stream, seconds):
                self._check_open()  # ended without the layer: a shutdown that gave the job up
            return
        deadline = time.monotonic() + seconds
        while True:
            slice_s = max(0.0, min(deadline - time.monotonic(), WAIT_SLICE_S))
            try:
                if not self._marks.wait(layer, stream, slice_s):
                    self._check_open()  # (as above)
                return
            except WaitTimeoutError as exc:
                self._check_open()  # a shutdown meanwhile: its jobs' layers will not come
                if time.monotonic() >= deadline:
                    raise WaitTimeoutError(
                        str(exc).replace(f"within {slice_s} s", f"within {seconds} s")
                    ) from None

    def __repr__(self) -> str:
        """The job and its layer count."""
        return f"LayerLoad(job {self.job_id}, {self.num_layers} layers)"
