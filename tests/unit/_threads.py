"""Run a test's function on several threads at once, with a deadline: a thread still running past
it fails the test as a deadlock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest


def run_at_once(target: Callable[[int], None], count: int, timeout_s: float) -> list[BaseException]:
    """Run ``target(i)`` for ``i`` in ``range(count)``, each on a daemon thread of its own, started
    together; return what they raised. Fails the test when a thread still runs ``timeout_s`` after
    the start (a deadlock: the caller must not then shut down what the stuck threads hold, so the
    failure is raised here, before any clean-up of the caller)."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(count)]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        pytest.fail(f"{count} threads started together still ran after {timeout_s} s: deadlocked")
    return errors
