"""The disk tier's requests: the handle a caller holds (:class:`DiskIO`), and the pieces (one system
call each) its threads move.

What a caller of ``DiskTier.write_records``/``read_records`` (the Worker's GPU <-> disk pipeline)
can rely on:

* the call validates, enqueues and returns a :class:`DiskIO` at once, from any thread; it never
  waits for I/O (it takes the tier's lock for bookkeeping only);
* until the handle is done, the tier's threads read (a write) or write (a read) its host rows:
  leave them alone. Once ``DiskIO.done()`` is true or ``DiskIO.wait(t)`` returned True, no thread of
  the tier touches them again, whatever the outcome, so the slot may be reused or handed to a copy
  engine (docs/design.md §5 rule 5 on the disk side; draining the host<->device copies is the Worker's part);
* ``ok`` means every record was written in full (the index then lists it under a new generation) or
  read and verified. With ``ok=False``, ``error`` is the failure of the lowest failed position (a
  :class:`~kvoffload.errors.DiskError` unless the tier shut down), ``failed`` names every failed
  position, and for a read their rows are zero-filled: never another block's bytes, never stale bytes
  presented as valid;
* a write reads each host row twice (CRC, then ``pwritev``): a row changed in between is detected by
  every later read (``checksum_mismatch``), never served;
* ``shutdown`` waits for these handles too, and stops every thread before the descriptor is closed.
"""

from __future__ import annotations

import threading

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload._jobs import as_timeout
from kvoffload.disk.config import DiskErrorKind
from kvoffload.records import Direction

__all__ = ["DiskIO", "Outcome", "Piece"]

I64Array = npt.NDArray[np.int64]
U8Array = npt.NDArray[np.uint8]


class DiskIO:
    """The handle of one request (a job, or a ``write_records``/``read_records`` call).

    ``done()``/``wait(timeout)`` say when every system call of the request finished; from then on no
    thread of the tier touches its host rows. ``ok``, ``error``, ``failed`` and ``seconds`` are final
    once done. Thread-safe.
    """

    def __init__(self, *, direction: Direction, job_id: int | None, disk_blocks: I64Array,
                 host_rows: I64Array, record_bytes: int, pieces: int) -> None:
        self.direction = direction
        self.job_id = job_id
        self.disk_blocks = disk_blocks
        self.host_rows = host_rows
        self.nbytes = int(disk_blocks.shape[0]) * record_bytes
        self._remaining = pieces
        self._event = threading.Event()
        self._errors: list[tuple[int, BaseException]] = []
        self._failed: list[int] = []
        self._start = 0.0
        self._end = 0.0
        self._serial: int | None = None

    def done(self) -> bool:
        """True once every system call of the request finished (never blocks)."""
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when done.

        Raises:
            InvalidArgumentError: a negative, NaN or infinite timeout.
        """
        return self._event.wait(as_timeout(timeout))

    @property
    def ok(self) -> bool:
        """True when done and every record moved (and, for a read, verified)."""
        return self._event.is_set() and not self._errors

    @property
    def error(self) -> BaseException | None:
        """The failure of the lowest failed position (None while running or when ok)."""
        if not self._event.is_set() or not self._errors:
            return None
        return min(self._errors, key=lambda item: item[0])[1]

    @property
    def failed(self) -> tuple[int, ...]:
        """Positions in the request (indices into its block lists) that failed, ascending."""
        return tuple(sorted(self._failed)) if self._event.is_set() else ()

    @property
    def seconds(self) -> float:
        """Wall time from the first system call's start to the last one's end (0.0 if none ran)."""
        return max(0.0, self._end - self._start) if self._event.is_set() else 0.0


@attrs.define(eq=False)
class Piece:
    """One system call's worth of a request: a run of consecutive disk blocks."""

    io: DiskIO
    write: bool
    first_block: int
    positions: I64Array
    rows: I64Array
    keys: list[bytes] | None
    outcome: Outcome | None = None
    headers: U8Array | None = None  # one page per record: built before a write, read by a read
    generation: int = 0  # of the first record (a write)
    index_valid: npt.NDArray[np.bool_] | None = None  # the index when a read was issued
    index_generation: npt.NDArray[np.uint64] | None = None


@attrs.define(eq=False)
class Outcome:
    """What one piece did (filled on the tier's threads, applied under the lock)."""

    start: float
    end: float = 0.0
    errors: list[tuple[int, BaseException]] = attrs.field(factory=list)
    failed: list[int] = attrs.field(factory=list)
    records_ok: int = 0
    kinds: list[DiskErrorKind] = attrs.field(factory=list)
