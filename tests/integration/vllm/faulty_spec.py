"""Offloading specs that vLLM loads by name in the tests, with faults injected into kvoffload's jobs.

``KVOffloadSpec.create_engine`` is the adapter's seam for the engine that moves the bytes; these
subclasses wrap the real :class:`kvoffload.Worker` in :class:`FaultyEngine`, which turns the result
of chosen attempts into a failure (``ok=False`` with a ``TransferError``, as a failed copy is
reported) after the real copy ran, and scribbles over a failed load's destination blocks (a failed
load leaves undefined bytes). Everything else is the real worker. vLLM builds the specs from
``kv_connector_extra_config`` exactly as it builds ``KVOffloadSpec``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import attrs
import numpy as np
import numpy.typing as npt
import torch

import kvoffload
from kvoffload import DeviceLayout, Direction, TransferError, TransferResult
from kvoffload.integrations.vllm import KVOffloadSpec, TransferEngine

I64Array = npt.NDArray[np.int64]


@attrs.define
class Submitted:
    """One job the adapter handed the engine."""

    job_id: int
    direction: Direction
    device_blocks: list[int]
    host_records: list[int]
    expedited: bool = False


class FaultyEngine:
    """A real worker whose chosen attempts come back failed (see the module docstring).

    ``fail(direction, attempt_index)`` decides, for the n-th attempt of a direction (0-based), whether
    it fails. Owns the wrapped worker (shut down by :meth:`shutdown`).
    """

    def __init__(self, worker: kvoffload.Worker, layout: DeviceLayout, spec: FaultySpec) -> None:
        self.worker = worker
        self.layout = layout
        self.spec = spec
        self.expedited_loads = worker.expedited_loads  # expedited loads take the worker's lane
        self.submitted: list[Submitted] = []
        self.failed: list[int] = []
        self._count = {Direction.STORE: 0, Direction.LOAD: 0}
        self._doomed: set[int] = set()

    def _note(self, job_id: int, direction: Direction, device: I64Array, host: I64Array,
              expedited: bool = False) -> None:
        self.submitted.append(Submitted(job_id, direction, device.tolist(), host.tolist(), expedited))
        if self.spec.should_fail(direction, self._count[direction]):
            self._doomed.add(job_id)
        self._count[direction] += 1

    def store(self, job_id: int, device_blocks: I64Array, host_blocks: I64Array) -> None:
        self.worker.store(job_id, device_blocks, host_blocks)
        self._note(job_id, Direction.STORE, device_blocks, host_blocks)

    def load(self, job_id: int, host_blocks: I64Array, device_blocks: I64Array, *,
             expedited: bool = False) -> None:
        self.worker.load(job_id, host_blocks, device_blocks, expedited=expedited)
        self._note(job_id, Direction.LOAD, device_blocks, host_blocks, expedited)

    def poll(self) -> list[TransferResult]:
        return [self._outcome(r) for r in self.worker.poll()]

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[TransferResult]:
        return [self._outcome(r) for r in self.worker.wait(job_ids, timeout)]

    def shutdown(self, timeout: float = 30.0) -> None:
        self.worker.shutdown(timeout)

    def _outcome(self, result: TransferResult) -> TransferResult:
        if result.job_id not in self._doomed:
            return result
        self._doomed.discard(result.job_id)
        self.failed.append(result.job_id)
        if result.direction is Direction.LOAD:
            job = next(s for s in self.submitted if s.job_id == result.job_id)
            garbage = torch.full((len(job.device_blocks), self.layout.record_bytes), 0x5A, dtype=torch.uint8)
            self.layout.scatter_records(job.device_blocks, garbage)
        error = TransferError(f"injected failure of {result.direction.value} job {result.job_id}")
        return attrs.evolve(result, ok=False, error=error)


class FaultySpec(KVOffloadSpec):
    """``KVOffloadSpec`` over a :class:`FaultyEngine`. Which attempts fail is set per test through
    the class attributes (vLLM builds the instance itself)."""

    fail_stores: ClassVar[set[int] | None] = set()  # attempt indexes that fail; None: every one
    fail_loads: ClassVar[set[int] | None] = set()
    engines: ClassVar[list[FaultyEngine]] = []

    @classmethod
    def configure(cls, *, fail_stores: set[int] | None = None, fail_loads: set[int] | None = None) -> None:
        """Choose the failing attempts (None fails every attempt) and forget earlier engines."""
        cls.fail_stores = set() if fail_stores is None else fail_stores
        cls.fail_loads = set() if fail_loads is None else fail_loads
        cls.engines = []

    @classmethod
    def fail_every(cls, direction: Direction) -> None:
        """Make every attempt of ``direction`` fail."""
        if direction is Direction.STORE:
            cls.fail_stores = None
        else:
            cls.fail_loads = None

    def should_fail(self, direction: Direction, index: int) -> bool:
        chosen = type(self).fail_stores if direction is Direction.STORE else type(self).fail_loads
        return chosen is None or index in chosen

    def create_engine(self, layout: DeviceLayout, num_host_records: int) -> TransferEngine:
        worker = kvoffload.Worker.create(layout, num_host_records,
                                         expedited_loads=self.options.expedited_loads)
        engine = FaultyEngine(worker, layout, self)
        type(self).engines.append(engine)
        return engine


class RecordingSpec(FaultySpec):
    """``KVOffloadSpec`` whose engine records every job and fails none."""

    def should_fail(self, direction: Direction, index: int) -> bool:
        return False
