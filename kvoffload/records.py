"""Plain records shared by every layer: directions, transfer results and statistics.

Records are frozen attrs classes: they are values, safe to hand to another thread or keep in a log.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Final, Union

import attrs
from typing_extensions import TypeAlias

if TYPE_CHECKING:  # only named in annotations: this module imports neither at run time
    from collections.abc import Mapping, Sequence
    from typing import Any

    import numpy as np
    import numpy.typing as npt
    import torch

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "BlockIds",
    "Direction",
    "DriverCallStats",
    "HandlerStats",
    "TransferResult",
    "WorkerStats",
]

#: How long a component's ``shutdown`` waits by default for its jobs to finish, in seconds.
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 30.0

#: Block ids as every job method accepts them: a sequence of ints, a 1-D integer numpy array, or a
#: 1-D integer torch tensor (on the CPU: ids are read on the host). Ids are copied at the call, so the
#: caller may reuse its buffer as soon as the call returns.
BlockIds: TypeAlias = Union["Sequence[int]", "npt.NDArray[np.integer[Any]]", "torch.Tensor"]


class Direction(enum.Enum):
    """Which way a job moves bytes.

    ``STORE`` reads device blocks and writes host records; ``LOAD`` reads host records and writes
    device blocks. With a disk tier: ``DEMOTE`` writes host records to disk records, ``PROMOTE``
    reads disk records into host records, ``STORE_TO_DISK`` and ``LOAD_FROM_DISK`` move device blocks
    to and from disk records through pinned bounce slots. With a remote tier: ``PUT_REMOTE`` stores
    host records in the remote store under keys, ``GET_REMOTE`` reads records by key into host
    records, verifying each.
    """

    STORE = "store"
    LOAD = "load"
    DEMOTE = "demote"
    PROMOTE = "promote"
    STORE_TO_DISK = "store_to_disk"
    LOAD_FROM_DISK = "load_from_disk"
    PUT_REMOTE = "put_remote"
    GET_REMOTE = "get_remote"

    # Members are singletons compared by identity: hash them by identity too (enum's own hash runs
    # Python code, and the submit path looks directions up several times per job).
    __hash__ = object.__hash__


@attrs.frozen
class TransferResult:
    """The outcome of one finished job.

    Attributes:
        job_id: the id the job was submitted with.
        direction: which way it moved bytes.
        ok: True only when every byte of the job was copied. With False, the destination blocks hold
            undefined bytes and ``error`` says why.
        nbytes: the bytes the job copies (0 for an empty job).
        seconds: time the copy ran on its stream (device time for the ``cuda`` backend, thread time
            for the ``host`` backend); 0.0 for empty jobs and jobs that failed before they ran.
        path: the transfer path that moved it (``"dma"``, ``"dma-loop"``, ``"host"``, ``"none"``; a
            remote job names its store, e.g. ``"mooncake"``).
        error: the exception that failed the job, or None.
    """

    job_id: int
    direction: Direction
    ok: bool
    nbytes: int
    seconds: float
    path: str
    error: BaseException | None = None


@attrs.frozen
class HandlerStats:
    """Counters of one direction since its handler was created.

    ``busy_seconds`` sums ``TransferResult.seconds`` of finished jobs; ``bytes_done`` counts bytes of
    jobs that finished with ``ok=True`` only.
    """

    direction: Direction
    submitted: int
    completed: int
    failed: int
    in_flight: int
    bytes_done: int
    busy_seconds: float

    @property
    def gbps(self) -> float:
        """Bytes of successful jobs over their summed copy time, in GB/s (0.0 before any)."""
        return self.bytes_done / self.busy_seconds / 1e9 if self.busy_seconds > 0 else 0.0


@attrs.frozen
class DriverCallStats:
    """Where the engine's thread waited inside the driver behind a native issuer (docs/design.md
    §16), counted since the issuer started: the driver serialises the calls of one context, so a
    caller's driver call (its fence's record in a hand-off, a layer's stream wait) waits while the
    issuing side (the issuer thread, or a caller issuing a job) is inside one of its own.

    ``longest_ns``: the issuing side's longest driver call of each kind ("record", "wait", "copy",
    "launch", "query"). ``slow_caller_calls``: the callers' calls longer than 100 us, by the kind of
    call the issuing side was in when they began ("none": in none). ``caller_calls`` and
    ``caller_longest_ns``: how many callers' calls were made, and the longest.
    """

    longest_ns: Mapping[str, int]
    slow_caller_calls: Mapping[str, int]
    caller_calls: int
    caller_longest_ns: int


@attrs.frozen
class WorkerStats:
    """A snapshot of a worker: its configuration and both directions' counters (``load``: the
    regular load lane; ``expedited``: the expedited load lane's, None without one)."""

    backend: str
    path: str
    num_device_blocks: int
    num_host_blocks: int
    record_bytes: int
    store: HandlerStats
    load: HandlerStats
    expedited: HandlerStats | None = None
