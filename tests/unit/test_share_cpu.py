"""The native issuer's thread and its caller on one CPU (``SHARE_CPU``, docs/design.md §16).

Over the no-op driver of :mod:`tests.cpu_profile` (the whole issue runs in C, without the GIL), with
the caller's thread and the worker's threads pinned to one CPU: the thread gives the CPU back to the
caller of every job it takes up there, and a waiter whose job is not issued yet yields its CPU;
with ``SHARE_CPU`` off nothing yields, and with the threads on another CPU nothing yields either. Every job's result is checked by the run. What the yields are worth is a timing,
printed by ``python -m tests.cpu_profile`` side by side, never asserted here.
"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from tests import cpu_profile

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or shutil.which("cc") is None,
    reason="needs Linux thread affinity and a C compiler",
)

JOBS = 12


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    """The no-op driver, compiled once for this module."""
    return cpu_profile._driver()  # noqa: SLF001


def test_on_one_cpu_the_thread_yields_to_the_caller_of_every_job_and_waiters_yield(lib: ctypes.CDLL) -> None:
    thread, waiters, _ = cpu_profile.shared_cpu_run(lib, share=True, together=True, jobs=JOBS).yields
    assert thread == JOBS  # each job taken up on the CPU its caller handed it over on
    assert waiters >= 1  # a caller back first waited for a job the thread had not issued


def test_without_share_cpu_nothing_yields(lib: ctypes.CDLL) -> None:
    assert cpu_profile.shared_cpu_run(lib, share=False, together=True, jobs=JOBS).yields == (0, 0, 0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_on_cpus_of_their_own_nothing_yields(lib: ctypes.CDLL) -> None:
    # a spin yields only where the side it waits for was last seen on its CPU: never to an
    # unrelated thread
    assert cpu_profile.shared_cpu_run(lib, share=True, together=False, jobs=JOBS).yields == (0, 0, 0)
