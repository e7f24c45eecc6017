"""A CUDA stream held on the device until the test lets it go: work a test enqueues behind the hold
(a job fenced on the stream) cannot finish before the release, whatever the host's speed.

:class:`DeviceHold` owns one word of pinned host memory, a stream of its own (made through the
driver, so no other component's stream is it) and a timer thread. The stream
waits on the device (``cuStreamWaitValue32``) until the word is set: by :meth:`DeviceHold.release`,
or by the timer once ``limit_s`` passed, so a test that never reaches its release (a call blocked
past its deadline) still ends the hold. :meth:`DeviceHold.close` (``with`` calls it) releases, stops
the timer and waits, bounded, until the stream passed the hold; only then may the word's memory go,
since the device reads it until then (a stream that does not pass keeps it, left to the process).
"""

from __future__ import annotations

import threading
import time
from typing import Final

import torch

from kvoffload.bindings.driver import create_stream, destroy_stream, stream_wait_word
from kvoffload.errors import InvalidArgumentError

#: How long :meth:`DeviceHold.close` waits for the stream to pass its released hold.
PASS_TIMEOUT_S: Final = 10.0
_POLL_S: Final = 0.001

#: Words whose stream had not passed its hold by the close's deadline: the device may still read
#: them, so their memory is kept for the process's life.
_kept: list[torch.Tensor] = []


class DeviceHold:
    """Holds :attr:`stream` on ``device`` until :meth:`release`, or ``limit_s`` at the latest.

    Work enqueued on :attr:`stream` after construction waits on the device; another stream that
    waits for an event recorded on it (a job's fence) waits too. Allocate nothing on it (torch's
    allocator would record the stream on its blocks, and the stream is destroyed at the close); the
    device may also hold work of other streams that share a hardware queue with it
    (``CUDA_DEVICE_MAX_CONNECTIONS``) until the release. :meth:`held` says whether the device
    is still held, :attr:`released_by_limit` whether the timer, not the test, released it.

    Raises:
        InvalidArgumentError: ``device`` is not a CUDA device, or ``limit_s`` not a finite number > 0.
        CudaError: the driver refused the wait (a device without stream memory operations).
    """

    def __init__(self, device: torch.device, limit_s: float) -> None:
        if device.type != "cuda":
            raise InvalidArgumentError(f"a DeviceHold needs a CUDA device, not {device}")
        if not isinstance(limit_s, (int, float)) or isinstance(limit_s, bool) or not 0 < limit_s < float("inf"):
            raise InvalidArgumentError(f"limit_s must be a finite number of seconds > 0, not {limit_s!r}")
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        # a stream of its own, not one of torch's shared pool, which another component's stream
        # could alias (and stall behind the hold)
        self._handle = create_stream(self._index)
        try:
            stream_wait_word(self._index, self._handle, self._word.data_ptr())
        except BaseException:
            destroy_stream(self._index, self._handle)
            raise
        self._lock = threading.Lock()
        self._released = False
        self.released_by_limit = False
        self._closed = False
        try:
            self.stream = torch.cuda.ExternalStream(self._handle, device=torch.device("cuda", self._index))  # type: ignore[no-untyped-call]
            self._passed = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._passed.record(self.stream)
            self._timer = threading.Timer(limit_s, self._release_at_limit)
            self._timer.daemon = True
            self._timer.name = "kvoffload-device-hold"
            self._timer.start()
        except BaseException:  # the wait is queued: let it go; the device may read the word a while
            self._set()
            _kept.append(self._word)
            destroy_stream(self._index, self._handle)  # released by the driver once its work ran
            raise

    def release(self) -> None:
        """Let the stream go on (idempotent)."""
        with self._lock:
            self._set()

    def _release_at_limit(self) -> None:
        with self._lock:
            if not self._released:
                self.released_by_limit = True
            self._set()

    def _set(self) -> None:
        self._word.numpy()[0] = 1
        self._released = True

    def held(self) -> bool:
        """Whether the device has not passed the hold yet (released or not)."""
        return not self._passed.query()  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Release, stop the timer, wait until the stream passed the hold and destroy the stream
        (once; later calls do nothing).

        Raises:
            AssertionError: the stream had not passed the released hold after
                :data:`PASS_TIMEOUT_S` (its word and stream are kept for the process's life).
        """
        if self._closed:
            return
        self._closed = True
        self.release()
        self._timer.cancel()
        self._timer.join(PASS_TIMEOUT_S)
        deadline = time.monotonic() + PASS_TIMEOUT_S
        while self.held():
            if time.monotonic() > deadline:
                _kept.append(self._word)
                raise AssertionError(f"the device had not passed a released hold after {PASS_TIMEOUT_S:.0f} s")
            time.sleep(_POLL_S)
        destroy_stream(self._index, self._handle)

    def __enter__(self) -> DeviceHold:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            self.close()
        except AssertionError:
            if exc_type is None:
                raise
            # the block's own error is the one to see; the word and stream stay with the process
