"""Rank processes for the shared pool tests: each one a real process (``multiprocessing`` spawn)
that plays one tensor-parallel rank of an engine, driven over a pipe by the test.

A process runs commands (``attach``, ``traffic``, ``write``, ``read``, ``release``,
``release_all``) until it is
told to stop or killed; its workers are shut down when it stops. A command answers ``("ok",
value)`` or ``("error", type name, message, ranks)``; ``traffic`` first answers ``("started",)``
so that a test can kill the process in the middle of it. The processes are started once per test
module (importing torch takes seconds) and restarted when a test killed one.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import torch

from kvoffload import DeviceLayout, SharedPool, Worker
from kvoffload.cli.demo import build_cache

#: Every command answers within this (the attaches in the tests have shorter deadlines).
REPLY_S: Final = 120.0
NUM_BLOCKS: Final = 32
HOST_BLOCKS: Final = 64
WAIT_S: Final = 60.0


def layout_of(rank: int) -> DeviceLayout:
    """Rank ``rank``'s cache (its own data): 2 layers, 4 pages of 16 KiB, a 64 KiB record."""
    tensors, block_dim = build_cache(
        "per-layer", num_blocks=NUM_BLOCKS, layers=2, kv_heads=2, head_dim=64, block_size=64,
        dtype=torch.bfloat16, device=torch.device("cpu"), seed=1000 + rank,
    )
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim)


def records_of(rank: int, blocks: list[int], record_bytes: int) -> torch.Tensor:
    """The bytes rank ``rank`` writes into host blocks ``blocks`` (a function of both)."""
    out = torch.empty(len(blocks), record_bytes, dtype=torch.uint8)
    for i, b in enumerate(blocks):
        out[i] = torch.from_numpy(np.random.default_rng(rank * 100_003 + b).integers(
            0, 256, record_bytes, dtype=np.uint8))
    return out


class _State:
    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self.conn = conn
        self.workers: dict[str, tuple[Worker, int]] = {}


def _attach(state: _State, name: str, world: int, rank: int, timeout: float,
            generation: int = 0, host_blocks: int = HOST_BLOCKS, launch: str | None = None) -> dict[str, float]:
    pool = SharedPool(name, world, generation=generation, attach_timeout_s=timeout, launch=launch)
    began = time.monotonic()
    worker = Worker.create(layout_of(rank), host_blocks, shared=pool.rank(rank))
    state.workers[name] = (worker, rank)
    return {"pid": os.getpid(), "seconds": time.monotonic() - began}


def _write(state: _State, name: str, host_blocks: list[int]) -> None:
    """Store this rank's bytes for ``host_blocks`` (through its device cache) into those blocks."""
    worker, rank = state.workers[name]
    layout = worker.layout
    step = NUM_BLOCKS // 2
    for start in range(0, len(host_blocks), step):
        part = host_blocks[start : start + step]
        device = list(range(len(part)))
        layout.scatter_records(device, records_of(rank, part, layout.record_bytes))
        worker.store(1, device, part)
        (result,) = worker.wait([1], WAIT_S)
        assert result.ok, result


def _read(state: _State, name: str, host_blocks: list[int]) -> bool:
    """Load ``host_blocks`` back to the device: do they hold exactly this rank's bytes?"""
    worker, rank = state.workers[name]
    layout = worker.layout
    device = list(range(NUM_BLOCKS - len(host_blocks), NUM_BLOCKS))
    layout.scatter_records(device, torch.zeros(len(device), layout.record_bytes, dtype=torch.uint8))
    worker.load(2, host_blocks, device)
    (result,) = worker.wait([2], WAIT_S)
    expected = records_of(rank, host_blocks, layout.record_bytes)
    return result.ok and torch.equal(layout.gather_records(device), expected)


def _traffic(state: _State, name: str, rounds: int, seed: int) -> int:
    """Rounds of store and load of random records through random host blocks, each verified;
    answers ``("started",)`` after the first round. Returns the jobs that completed."""
    worker, _ = state.workers[name]
    layout = worker.layout
    rng = np.random.default_rng(seed)
    half = layout.num_blocks // 2
    done = 0
    for i in range(rounds):
        n = int(rng.integers(1, 9))
        src, dst = rng.choice(half, n, replace=False), half + rng.choice(half, n, replace=False)
        host = rng.choice(worker.num_host_blocks, n, replace=False)
        layout.scatter_records(src, torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8))
        expected = layout.gather_records(src)
        worker.store(10 + 2 * i, src, host)
        assert worker.wait([10 + 2 * i], WAIT_S)[0].ok
        worker.load(11 + 2 * i, host, dst)
        assert worker.wait([11 + 2 * i], WAIT_S)[0].ok
        assert torch.equal(layout.gather_records(dst), expected), f"round {i}: loaded bytes differ"
        done += 2
        if i == 0:
            state.conn.send(("started",))
    return done


def _release(state: _State, name: str) -> None:
    worker, _ = state.workers.pop(name)
    worker.shutdown()


def _release_all(state: _State) -> None:
    for name in list(state.workers):
        _release(state, name)


_COMMANDS: Final[dict[str, Callable[..., Any]]] = {
    "attach": _attach, "write": _write, "read": _read, "traffic": _traffic, "release": _release,
    "release_all": _release_all,
}


def serve(conn: multiprocessing.connection.Connection) -> None:
    """The rank process's loop (see the module docstring)."""
    state = _State(conn)
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            command, kwargs = message
            try:
                conn.send(("ok", _COMMANDS[command](state, **kwargs)))
            except BaseException as exc:
                conn.send(("error", type(exc).__name__, str(exc), getattr(exc, "ranks", None)))
    finally:
        for worker, _ in state.workers.values():
            worker.shutdown()


class RankError(Exception):
    """What a rank process's command raised: ``kind`` is the exception's class name."""

    def __init__(self, kind: str, message: str, ranks: tuple[int, ...] | None) -> None:
        self.kind = kind
        self.ranks = tuple(ranks) if ranks is not None else None
        super().__init__(f"{kind}: {message}")


class RankProcess:
    """One rank process, driven from the test (owns the process and the pipe)."""

    def __init__(self, context: multiprocessing.context.SpawnContext) -> None:
        self._conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None
        return pid

    def send(self, command: str, **kwargs: Any) -> None:
        """Start ``command``; its answer comes from :meth:`answer`."""
        self._conn.send((command, kwargs))

    def answer(self, timeout: float = REPLY_S) -> Any:
        """The next answer: its value, or :class:`RankError`."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"rank process {self.pid} did not answer in {timeout} s")
        message = self._conn.recv()
        if message[0] == "error":
            raise RankError(message[1], message[2], message[3])
        return message[1] if message[0] == "ok" else message[0]

    def call(self, command: str, **kwargs: Any) -> Any:
        self.send(command, **kwargs)
        return self.answer()

    def kill(self) -> None:
        """``kill -9``, and reap it."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(REPLY_S)

    def stop(self) -> None:
        """Stop it (its workers shut down); killed if it does not stop in time."""
        if self.process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self.process.join(REPLY_S)
        if self.process.is_alive():
            self.kill()
        self._conn.close()


class RankProcesses:
    """``count`` rank processes for a test module; a killed or stopped one is replaced on use."""

    def __init__(self, count: int) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._procs = [RankProcess(self._context) for _ in range(count)]

    def __getitem__(self, index: int) -> RankProcess:
        if not self._procs[index].process.is_alive():
            self._procs[index].stop()
            self._procs[index] = RankProcess(self._context)
        return self._procs[index]

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.process.is_alive()]

    def close(self) -> None:
        for proc in self._procs:
            proc.stop()
