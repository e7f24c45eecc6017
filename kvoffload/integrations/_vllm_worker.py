"""vLLM's worker side of :mod:`kvoffload.integrations.vllm`: :class:`KVOffloadWorker` runs vLLM's
transfers on a :class:`TransferEngine` (a :class:`kvoffload.Worker`) and retries failed jobs;
:class:`HostChunkSpec` is the host side of a transfer, built by the scheduler-side manager. The
public names are exported by :mod:`kvoffload.integrations.vllm`, whose docstring says what they do.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt
import vllm

import kvoffload
from kvoffload import Direction, WaitTimeoutError
from kvoffload.integrations.vllm_support import (
    VLLMConfigError,
    VLLMTransferError,
    check_vllm_version,
    job_records,
)

check_vllm_version(vllm.__version__)

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker  # noqa: E402
from vllm.v1.kv_offload.base import TransferResult as VLLMTransferResult  # noqa: E402

__all__ = ["HostChunkSpec", "KVOffloadWorker", "TransferEngine"]

_log = logging.getLogger("kvoffload.integrations.vllm")

I64Array = npt.NDArray[np.int64]


class HostChunkSpec(LoadStoreSpec):
    """Where a transfer's chunks live in the host pool: one chunk id per offloaded key, in the order
    of the keys (and so of the GPU spec's groups). Built by the manager, read by the worker."""

    def __init__(self, chunk_ids: Sequence[int]) -> None:
        self.chunk_ids: I64Array = np.asarray(chunk_ids, dtype=np.int64).reshape(-1)

    def __repr__(self) -> str:
        return f"HostChunkSpec({self.chunk_ids.tolist()})"


# ------------------------------------------------------------------------------------- worker


class TransferEngine(Protocol):
    """What :class:`KVOffloadWorker` needs from the engine that moves the bytes: the job calls of
    :class:`kvoffload.Worker` (which is one). The seam where tests inject faults and where a pool
    shared by tensor-parallel ranks will plug in."""

    def store(self, job_id: int, device_blocks: I64Array, host_blocks: I64Array) -> None: ...

    def load(self, job_id: int, host_blocks: I64Array, device_blocks: I64Array, *,
             expedited: bool = ...) -> None: ...

    def poll(self) -> list[kvoffload.TransferResult]: ...

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[kvoffload.TransferResult]: ...

    def shutdown(self, timeout: float = ...) -> None: ...


@attrs.define(eq=False)
class _Attempt:
    vllm_job: int
    direction: Direction
    device: I64Array
    host: I64Array
    attempt: int
    expedited: bool = False


class KVOffloadWorker(OffloadingWorker):
    """vLLM's worker-side transfers, run by a :class:`TransferEngine` (a :class:`kvoffload.Worker`).

    Owns the engine (shut down by :meth:`shutdown`, once) and the book of attempts in flight.
    Called from vLLM's worker thread only. See the module docstring for failures and retries.
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        blocks_per_chunk: int,
        transfer_retries: int,
        wait_timeout_s: float,
        expedited_lane: bool = False,
    ) -> None:
        """``expedited_lane``: the engine has the expedited load lane (a worker created with
        ``expedited_loads=True``), so expedited loads go to it (without it they share the regular
        lane)."""
        self._engine = engine
        self._expedited_lane = expedited_lane
        self._blocks_per_chunk = blocks_per_chunk
        self._retries = transfer_retries
        self._wait_timeout_s = wait_timeout_s
        self._ids = itertools.count()
        self._attempts: dict[int, _Attempt] = {}  # engine job id -> attempt
        self._current: dict[int, int] = {}  # vLLM job id -> engine job id of its current attempt
        self._finished: list[VLLMTransferResult] = []  # returned by wait, reported by get_finished
        self._closed = False

    @property
    def engine(self) -> TransferEngine:
        """The engine that moves the bytes (borrowed for inspection)."""
        return self._engine

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Copy the GPU blocks of ``src_spec`` into the host records of ``dst_spec``'s chunks, after
        the work queued on the current stream. Returns True; a spec that does not add up raises
        :class:`VLLMConfigError` and kvoffload's validation errors propagate (nothing submitted)."""
        device, host = job_records(
            src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices,
            _chunk_ids(dst_spec), self._blocks_per_chunk,
        )
        self._submit(_Attempt(job_id, Direction.STORE, device, host, 0))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Copy the host records of ``src_spec``'s chunks into the GPU blocks of ``dst_spec``, after
        the work queued on the current stream. ``expedited`` loads (vLLM waits for them within the
        step) go through the engine's second load lane, so that they do not queue behind the
        regular loads (with ``expedited_loads`` false they share the regular lane). Returns True;
        raises as :meth:`submit_store`."""
        device, host = job_records(
            dst_spec.block_ids, dst_spec.group_sizes, dst_spec.block_indices,
            _chunk_ids(src_spec), self._blocks_per_chunk,
        )
        self._submit(_Attempt(job_id, Direction.LOAD, device, host, 0,
                              expedited=bool(expedited) and self._expedited_lane))
        return True

    def get_finished(self) -> list[VLLMTransferResult]:
        """The jobs finished since the last call (including those ``wait`` saw finish).

        Raises:
            VLLMTransferError: a job failed on every attempt.
        """
        self._check_open()
        finished, self._finished = self._finished, []
        return finished + self._settle(self._engine.poll())

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (their results come from the next ``get_finished``);
        ids this worker does not hold in flight are ignored.

        Raises:
            VLLMTransferError: a job failed on every attempt, or the jobs did not finish within
                ``wait_timeout_s``.
        """
        self._check_open()
        deadline = time.monotonic() + self._wait_timeout_s
        while True:
            pending = [self._current[j] for j in job_ids if j in self._current]
            if not pending:
                return
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise WaitTimeoutError("the deadline passed", pending)
                done = self._engine.wait(pending, left)
            except WaitTimeoutError as exc:
                late = sorted(self._attempts[i].vllm_job for i in exc.pending if i in self._attempts)
                raise VLLMTransferError(
                    f"vLLM job(s) {late} did not finish within wait_timeout_s = "
                    f"{self._wait_timeout_s} s",
                    late[0] if late else -1,
                ) from exc
            self._finished += self._settle(done)

    def shutdown(self) -> None:
        """Drain and release the engine (kvoffload's shutdown contract), once; later calls do
        nothing. Raises kvoffload's ``ShutdownError`` after all cleanup when something failed."""
        if self._closed:
            return
        self._closed = True
        self._attempts.clear()
        self._current.clear()
        self._finished.clear()
        self._engine.shutdown(self._wait_timeout_s)

    def _submit(self, attempt: _Attempt) -> None:
        self._check_open()
        internal = next(self._ids)
        if attempt.direction is Direction.STORE:
            self._engine.store(internal, attempt.device, attempt.host)
        elif attempt.expedited:
            self._engine.load(internal, attempt.host, attempt.device, expedited=True)
        else:
            self._engine.load(internal, attempt.host, attempt.device)
        self._attempts[internal] = attempt
        self._current[attempt.vllm_job] = internal

    def _settle(self, results: Iterable[kvoffload.TransferResult]) -> list[VLLMTransferResult]:
        out: list[VLLMTransferResult] = []
        for result in results:
            attempt = self._attempts.pop(result.job_id)
            if result.ok:
                del self._current[attempt.vllm_job]
                out.append(VLLMTransferResult(attempt.vllm_job, True, result.nbytes, result.seconds))
                continue
            what = attempt.direction.value
            if attempt.attempt < self._retries:
                _log.warning(
                    "kvoffload %s of vLLM job %d failed (attempt %d of %d), resubmitting: %s",
                    what, attempt.vllm_job, attempt.attempt + 1, self._retries + 1, result.error,
                )
                self._submit(attrs.evolve(attempt, attempt=attempt.attempt + 1))
                continue
            del self._current[attempt.vllm_job]
            consequence = (
                "its keys were never reported stored, so they never become loadable"
                if attempt.direction is Direction.STORE
                else "its GPU blocks hold undefined bytes"
            )
            raise VLLMTransferError(
                f"kvoffload {what} of vLLM job {attempt.vllm_job} failed on all "
                f"{attempt.attempt + 1} attempt(s) (GPU blocks {attempt.device[:8].tolist()}, host "
                f"records {attempt.host[:8].tolist()}): {result.error}; {consequence}. vLLM's "
                "OffloadingConnector cannot take a failed job, so the engine stops here",
                attempt.vllm_job,
            ) from result.error
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise kvoffload.ClosedError("the KVOffloadWorker was shut down")


def _chunk_ids(spec: object) -> I64Array:
    if not isinstance(spec, HostChunkSpec):
        raise VLLMConfigError(
            f"a transfer's host side is a {type(spec).__name__}, not a HostChunkSpec: the scheduler "
            "and the workers must both use KVOffloadSpec"
        )
    return spec.chunk_ids
