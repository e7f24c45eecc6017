"""The lane: the one thread that makes every call into a remote store's client, and the calls it runs.

Owns its thread and its queue of :class:`Op` (one per store call: inputs, per-key outcome, state).
``Lane.lock`` guards the queue, the running op and every op's state. A call is PENDING in the
queue, RUNNING on the lane, then DONE; its caller may give up on it at its deadline: a PENDING op is
CANCELLED (dropped, never started), a RUNNING one ABANDONED (the client still has it; the lane
finishes it and then calls its ``on_settled``, outside the lock).
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.errors import RemoteError
from kvoffload.remote._types import RemoteErrorKind, RemoteOp, remote_error

__all__ = ["Lane", "Op", "OpState"]

_log = logging.getLogger("kvoffload.remote")

I64Array = npt.NDArray[np.int64]


class OpState(enum.Enum):
    """Where a call is (see the module docstring)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    ABANDONED = "abandoned"


class Op:
    """One call: its inputs, its per-key outcome and its state (guarded by the store's lock)."""

    def __init__(
        self,
        kind: RemoteOp,
        keys: list[bytes],
        rows: I64Array | None,
        deadline: float,
        generations: list[int | None] | None = None,
        on_settled: Callable[[], None] | None = None,
    ) -> None:
        n = len(keys)
        self.kind = kind
        self.keys = keys
        self.rows = rows
        self.deadline = deadline
        self.expected = generations
        self.state = OpState.PENDING
        self.done = threading.Event()
        self.succeeded = [False] * n
        self.errors: list[RemoteError | None] = [None] * n
        self.generations = [0] * n
        self.nbytes = 0
        self.put_generations: list[int] = []
        self.settled = True
        self.on_settled = on_settled

    def fail(self, i: int, kind: RemoteErrorKind, message: str, code: int | None = None) -> None:
        """Fail key ``i`` with the typed error of ``kind``."""
        self.succeeded[i] = False
        self.errors[i] = remote_error(kind, f"key {self.keys[i]!r}: {message}", (self.keys[i],), code=code)


class Lane:
    """The thread that runs every client call of one store, in FIFO order, and its queue.

    ``lock`` guards the queue, the running op and every op's state; ``cond`` (on the same lock)
    wakes the lane and ``wait_idle``.
    """

    def __init__(self, name: str) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.queue: collections.deque[Op] = collections.deque()
        self.running: Op | None = None
        self._stopping = False
        self._name = name
        self._thread: threading.Thread | None = None
        self._run: Callable[[Op], None] | None = None
        self._finish: Callable[[Op], None] | None = None
        self._on_exit: Callable[[], None] | None = None
        self._exited = False

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` on a fresh thread before the lane starts (client set-up), with a deadline.

        Returns its result, re-raises its exception, or raises ``TimeoutError`` (the thread is left
        running as a daemon; what it creates is then never released).
        """
        box: list[Any] = []
        errors: list[BaseException] = []

        def target() -> None:
            try:
                box.append(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors.append(exc)

        thread = threading.Thread(target=target, name=f"{self._name}-setup", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{self._name}: set-up did not finish within {timeout:g} s")
        if errors:
            raise errors[0]
        return box[0]

    def start(self, run: Callable[[Op], None]) -> None:
        """Start the thread; it runs ``run(op)`` for each op pushed, in FIFO order."""
        self._run = run
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def bind_finish(self, finish: Callable[[Op], None]) -> None:
        """``finish(op)`` runs on the lane, under the lock, after each op returned from ``run``."""
        self._finish = finish

    def push(self, op: Op, check: Callable[[], None]) -> None:
        """Queue ``op`` after ``check()`` (under the lock: it raises to refuse)."""
        with self.cond:
            check()
            self.queue.append(op)
            self.cond.notify_all()

    def drop(self, op: Op) -> None:
        """Under the lock: remove a cancelled op from the queue."""
        try:
            self.queue.remove(op)
        except ValueError:
            pass
        self.cond.notify_all()

    def release_when_stopped(self, release: Callable[[], None]) -> bool:
        """Have the lane call ``release`` as it exits; False, and nothing registered, if it exited."""
        with self.cond:
            if self._exited:
                return True
            self._on_exit = release
            return False

    def _loop(self) -> None:
        assert self._run is not None
        while True:
            with self.cond:
                while not self.queue and not self._stopping:
                    self.cond.wait()
                if not self.queue:
                    self._exited = True
                    on_exit, self._on_exit = self._on_exit, None
                    self.cond.notify_all()
                    break
                op = self.queue.popleft()
                if op.state is not OpState.PENDING:
                    self.cond.notify_all()
                    continue
                op.state = OpState.RUNNING
                self.running = op
            self._run(op)
            with self.cond:
                if self._finish is not None:
                    self._finish(op)
                abandoned = op.state is OpState.ABANDONED
                if op.state is OpState.RUNNING:
                    op.state = OpState.DONE
                self.running = None
                op.done.set()
                self.cond.notify_all()
            if abandoned and op.on_settled is not None:
                try:
                    op.on_settled()
                except Exception:  # noqa: BLE001 - a caller's callback must not stop the lane
                    _log.exception("%s: on_settled of an abandoned %s raised", self._name, op.kind.value)
        if on_exit is not None:
            on_exit()

    def stop(self, deadline: float, cancelled: Callable[[Op], None]) -> bool:
        """Let the queued ops run until ``deadline``, then fail the rest (``closed``, each handed to
        ``cancelled`` before its caller wakes) and wake the caller of an op still running (it finds
        it abandoned); join the thread; True if it stopped."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
            while (self.queue or self.running is not None) and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            if self.running is not None:
                self.running.done.set()  # its caller stops waiting: the call is abandoned
            for op in self.queue:
                op.state = OpState.CANCELLED
                for i in range(len(op.keys)):
                    op.fail(i, RemoteErrorKind.CLOSED, "the store was closed before the call started")
                cancelled(op)
                op.done.set()
            self.queue.clear()
            self.cond.notify_all()
        thread = self._thread
        if thread is None:
            return True
        thread.join(max(0.0, deadline - time.monotonic()))
        return not thread.is_alive()
