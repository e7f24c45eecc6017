"""The shared machinery of the remote stores (lane, deadlines, close) over kvoffload.testing's
in-memory client, whose gate holds a call until the test opens it.

The stores themselves run against real services in tests/remote; these cases need a client that
hangs or answers on command, which a real service cannot do deterministically.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from kvoffload.errors import RemoteShutdownError, RemoteTimeoutError, RemoteUnavailableError
from kvoffload.remote._base import HEADER_SLOTS, RemoteStoreBase
from kvoffload.remote._lane import Lane
from kvoffload._record import PAGE_BYTES
from kvoffload.testing.memory_store import MemoryClient

RECORD = PAGE_BYTES
U8 = np.ndarray[Any, np.dtype[np.uint8]]


def make_store(n: int = 16, batch: int = 4) -> tuple[RemoteStoreBase, MemoryClient, U8]:
    rows = np.random.default_rng(0).integers(0, 256, size=(n, RECORD), dtype=np.uint8)
    client = MemoryClient(rows)
    store = RemoteStoreBase(
        client=client, host_rows=rows, headers=np.zeros((HEADER_SLOTS * batch, PAGE_BYTES), np.uint8),
        fingerprint=b"fp", batch_records=batch, checksum_threads=2, lane=Lane("kvoffload-test-lane"),
    )
    return store, client, rows


def test_a_round_trip_over_many_chunks_is_bit_exact() -> None:
    store, _, rows = make_store(n=32, batch=3)
    keys = [b"k%d" % i for i in range(16)]
    assert store.put(keys, range(16), timeout=10).ok
    got = store.get(keys, range(16, 32), timeout=10)
    assert got.ok and np.array_equal(rows[16:], rows[:16])
    store.close()


def test_close_leaves_a_stuck_client_open_and_says_so() -> None:
    store, client, rows = make_store()
    assert store.put([b"a"], [0], timeout=10).ok
    client.gate = threading.Event()
    rows[1] = 0xEE
    result = store.get([b"a"], [1], timeout=0.2)
    assert not result.settled and isinstance(result.error, RemoteTimeoutError)
    assert not result.error.settled
    assert store.stats().busy == 1 and store.stats().abandoned == 1
    with pytest.raises(RemoteShutdownError) as info:
        store.close(timeout=0.2)
    assert info.value.client_left_open and client.closed == 0
    client.gate.set()
    assert store.wait_idle(10)
    assert not rows[1].any(), "the rows of an abandoned get are zero-filled once it returns"
    deadline = time.monotonic() + 10
    while client.closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.closed == 1, "the lane releases the client when the stuck call returns"
    store.close()  # idempotent: the second close does nothing


class CloseHangs(MemoryClient):
    """A client whose close waits for ``gate`` (a service that stopped answering)."""

    gate_close = threading.Event()

    def close(self) -> None:
        assert self.gate_close.wait(30)
        super().close()


def test_close_returns_by_its_deadline_while_the_clients_close_hangs_and_says_so() -> None:
    """The client's close ran on the closing thread without a deadline: a shutdown(0.5) returned
    after as long as it hung (found by an audit). It runs on a thread of its own, joined by the
    deadline; past it the error says the client is left open, and the close still runs once."""
    rows = np.zeros((4, RECORD), dtype=np.uint8)
    client = CloseHangs(rows)
    CloseHangs.gate_close = threading.Event()
    store = RemoteStoreBase(
        client=client, host_rows=rows, headers=np.zeros((HEADER_SLOTS * 4, PAGE_BYTES), np.uint8),
        fingerprint=b"fp", batch_records=4, checksum_threads=1, lane=Lane("kvoffload-test-lane"),
    )
    errors: list[RemoteShutdownError | None] = []
    closer = threading.Thread(target=lambda: errors.append(_close(store)), daemon=True)
    closer.start()
    closer.join(10)
    returned = not closer.is_alive()
    CloseHangs.gate_close.set()
    closer.join(30)
    assert returned, "close waited for the client's close past its deadline"
    (error,) = errors
    assert error is not None and error.client_left_open and "close had not returned" in str(error)
    deadline = time.monotonic() + 10
    while client.closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.closed == 1


def _close(store: RemoteStoreBase) -> RemoteShutdownError | None:
    try:
        store.close(timeout=0.2)
    except RemoteShutdownError as exc:
        return exc
    return None


def test_close_fails_the_calls_still_queued_and_zero_fills_their_rows() -> None:
    store, client, rows = make_store()
    assert store.put([b"a", b"b"], [0, 1], timeout=10).ok
    client.gate = threading.Event()
    client.entered.clear()
    results: dict[str, Any] = {}
    first = threading.Thread(target=lambda: results.setdefault("first", store.get([b"a"], [2], timeout=30)))
    first.start()
    assert client.entered.wait(10)
    second = threading.Thread(target=lambda: results.setdefault("second", store.get([b"b"], [3], timeout=30)))
    second.start()
    deadline = time.monotonic() + 10
    while not store._lane.queue and time.monotonic() < deadline:  # the second call is queued
        time.sleep(0.001)

    def close() -> None:
        try:
            store.close(timeout=1.0)
        except RemoteShutdownError as exc:
            results["close"] = exc

    closer = threading.Thread(target=close)
    rows[3] = 0xEE
    closer.start()
    second.join(10)
    assert isinstance(results["second"].error, RemoteUnavailableError)
    assert results["second"].error.kind == "closed" and not rows[3].any()
    closer.join(10)
    assert results["close"].client_left_open  # the first call was still inside the client
    first.join(10)
    assert not first.is_alive(), "the close deadline released the caller of the call inside the client"
    error = results["first"].error
    assert isinstance(error, RemoteTimeoutError) and not error.settled and "close deadline" in str(error)
    client.gate.set()
    assert store.wait_idle(10)
    assert not rows[2].any(), "the abandoned get's row is zero-filled once it returned"


def test_a_deadline_that_passes_before_the_call_starts_leaves_the_client_untouched() -> None:
    store, client, rows = make_store()
    client.gate = threading.Event()
    client.entered.clear()
    blocker = threading.Thread(target=lambda: store.exists([b"x"], timeout=10))
    blocker.start()
    assert client.entered.wait(10)
    rows[5] = 0xEE
    result = store.get([b"x"], [5], timeout=0.05)
    assert result.settled and isinstance(result.error, RemoteTimeoutError) and result.error.settled
    assert not rows[5].any()
    client.gate.set()
    blocker.join(10)
    assert store.wait_idle(10)
    assert store.stats().failures["timeout"] == 1
    store.close()


def test_host_rows_may_be_a_cpu_torch_tensor_and_bad_rows_are_refused() -> None:
    import torch

    from kvoffload.errors import ArgumentTypeError, InvalidArgumentError
    from kvoffload.remote._args import as_host_rows

    tensor = torch.zeros((4, PAGE_BYTES), dtype=torch.uint8)
    view = as_host_rows(tensor)
    view[1, 7] = 9
    assert int(tensor[1, 7]) == 9, "the rows are borrowed, not copied"
    with pytest.raises(ArgumentTypeError):
        as_host_rows(torch.zeros((4, PAGE_BYTES), dtype=torch.float32))
    with pytest.raises(InvalidArgumentError):
        as_host_rows(np.zeros((4, 1000), dtype=np.uint8))
    with pytest.raises(InvalidArgumentError):
        as_host_rows(np.zeros((4, 2 * PAGE_BYTES), dtype=np.uint8)[:, ::2])
    with pytest.raises(ArgumentTypeError):
        as_host_rows([[0] * PAGE_BYTES])


def test_on_settled_runs_once_the_client_returned_an_abandoned_call_after_its_rows_were_zeroed() -> None:
    store, client, rows = make_store()
    assert store.put([b"a"], [0], timeout=10).ok
    seen: list[bool] = []
    settled = threading.Event()

    def on_settled() -> None:
        seen.append(bool(rows[1].any()))
        settled.set()

    assert store.get([b"a"], [2], timeout=10, on_settled=on_settled).ok  # settled: never called
    client.gate = threading.Event()
    rows[1] = 0xEE
    result = store.get([b"a"], [1], timeout=0.2, on_settled=on_settled)
    assert not result.settled
    assert not settled.wait(0.2), "called while the client still had the call"
    client.gate.set()
    assert settled.wait(10)
    assert seen == [False], "called once, after the abandoned get's rows were zero-filled"
    store.close()


def test_a_raising_on_settled_does_not_stop_the_lane() -> None:
    store, client, rows = make_store()
    assert store.put([b"a"], [0], timeout=10).ok
    client.gate = threading.Event()

    def boom() -> None:
        raise RuntimeError("callback failed")

    assert not store.get([b"a"], [1], timeout=0.1, on_settled=boom).settled
    client.gate.set()
    assert store.wait_idle(10)
    client.gate = None
    assert store.get([b"a"], [1], timeout=10).ok
    store.close()


@pytest.mark.parametrize("call", ["exists", "put"])
def test_a_key_the_client_answers_after_its_deadline_failed_it_is_not_reported_succeeded(call: str) -> None:
    """The caller fails every key of a call past its deadline, under the store's lock; the lane,
    which writes without it, could still mark a key succeeded before the caller's snapshot: a
    result with a key succeeded and failed at once, and a put counted in the stats (found by a
    review). Here the client answers between the two."""
    store, client, _ = make_store()
    assert store.put([b"a"], [0], timeout=10).ok
    client.gate = threading.Event()
    real_fail_all = store._fail_all
    answered = threading.Event()

    def fail_all_then_let_the_client_answer(op: Any, *, settled: bool) -> None:
        real_fail_all(op, settled=settled)
        client.gate.set()  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while not op.succeeded[0] and time.monotonic() < deadline:  # the lane's write, unlocked
            time.sleep(0.001)
        if op.succeeded[0]:
            answered.set()

    store._fail_all = fail_all_then_let_the_client_answer  # type: ignore[method-assign]
    before = store.stats()
    result = store.exists([b"a"], timeout=0.2) if call == "exists" else store.put([b"b"], [1], timeout=0.2)
    assert answered.is_set(), "the client did not answer before the snapshot: the test proves nothing"
    assert isinstance(result.errors[0], RemoteTimeoutError) and not result.settled
    assert result.succeeded == (False,) and result.generations == (0,) and result.nbytes == 0
    assert store.stats().records_put == before.records_put
    assert store.wait_idle(10)
    store.close()
