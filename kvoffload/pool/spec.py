"""``SharedPool`` and ``PoolRank``: what every rank of one engine names to share one host pool
(docs/design.md §13).

Plain validated values (no resource): a ``SharedPool`` is built with the same arguments on every
rank (or built once and sent to the ranks); ``pool.rank(r)`` is what rank ``r`` hands to
``Worker.create(..., shared=...)``. ``SharedPool.inspect`` maps a pool for tests and operators.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any, Final

import attrs

from kvoffload._seconds import MAX_TIMEOUT_S
from kvoffload.errors import ArgumentTypeError, InvalidArgumentError
from kvoffload.pool.header import MAX_WORLD_SIZE, NO_LAUNCH

if TYPE_CHECKING:
    from kvoffload.pool.view import PoolView

__all__ = ["DEFAULT_ATTACH_TIMEOUT_S", "PoolRank", "SharedPool", "check_pool_name"]

#: How long a rank waits for the others to arrive and map the pool, by default. Engines start their
#: ranks within seconds of each other; mapping and pinning a pool of hundreds of GiB takes tens.
DEFAULT_ATTACH_TIMEOUT_S: Final = 300.0
_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_MAX_GENERATION: Final = (1 << 64) - 1
#: The longest ``launch`` token, in characters.
MAX_LAUNCH_CHARS: Final = 256


def check_pool_name(name: object, argument: str = "name") -> str:
    """``name`` if it can name a file under ``/dev/shm``, else :class:`InvalidArgumentError`
    (:class:`ArgumentTypeError` for a name that is not a str) naming ``argument``."""
    if not isinstance(name, str):
        raise ArgumentTypeError(f"{argument} = {name!r} must be a str, not a {type(name).__name__}")
    if not _NAME_PATTERN.fullmatch(name):
        raise InvalidArgumentError(
            f"{argument} = {name!r} must be 1-200 characters of letters, digits, '.', '_' or '-', "
            "not starting with '.', '_' or '-'"
        )
    return name


def _check_name(_instance: object, _attribute: object, value: Any) -> None:
    check_pool_name(value)


def _check_int(name: str, value: object, least: int, most: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} = {value!r} must be an int, not a {type(value).__name__}")
    if not least <= value <= most:
        raise InvalidArgumentError(f"{name} = {value} must be between {least} and {most}")


def _check_world(_instance: object, _attribute: object, value: Any) -> None:
    _check_int("world_size", value, 1, MAX_WORLD_SIZE)


def _check_generation(_instance: object, _attribute: object, value: Any) -> None:
    _check_int("generation", value, 0, _MAX_GENERATION)


def _check_launch(_instance: object, _attribute: object, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise ArgumentTypeError(f"launch = {value!r} must be a str or None, not a {type(value).__name__}")
    if not 1 <= len(value) <= MAX_LAUNCH_CHARS:
        raise InvalidArgumentError(
            f"launch must be 1-{MAX_LAUNCH_CHARS} characters (a token unique to this launch of the "
            f"engine), not {len(value)}"
        )


def _check_timeout(_instance: object, _attribute: object, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"attach_timeout_s = {value!r} must be a number of seconds")
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN and inf fail it too
        raise InvalidArgumentError(f"attach_timeout_s = {value!r} must be a finite number > 0")


@attrs.frozen
class SharedPool:
    """One host pool that the ``world_size`` tensor-parallel ranks of one engine map together
    (docs/design.md §13).

    Every rank builds it with the same values and passes ``pool.rank(r)`` to ``Worker.create(...,
    shared=...)``, which returns once every rank mapped the pool. Block ``b`` of the pool holds every
    rank's slice of that block, side by side (one contiguous byte range); a rank's copies touch
    only its own slices, and ``Worker.host_records()`` shows them.

    Attributes:
        name: the file ``/dev/shm/<name>`` while the ranks attach (unlinked once all mapped it).
        world_size: the number of ranks (1 to 64).
        generation: an int the ranks of one engine launch agree on (e.g. a launch counter): a file
            of another generation is never joined (replaced when its processes are gone, a
            :class:`~kvoffload.errors.PoolCollisionError` while they live).
        launch: a token unique to this launch of the engine, the same on every rank (e.g. drawn by
            one rank and sent to the others, or the launcher's job id), or None. With it a rank
            tells its own launch's file from another's: a file of another launch (or of ranks that
            named none) is never joined, even under the same name, generation and world size
            (replaced when its processes are gone, a
            :class:`~kvoffload.errors.PoolCollisionError` while they live), so two engines
            started at once under one name fail instead of taking each other's ranks. A file of
            this launch that a rank of it still holds, whose attach failed or lost a rank, fails
            the rank at once with that attach's error. A stale file (every rank gone) is replaced
            whatever its launch (a restart that reuses its token, e.g. a job id, takes
            the crashed attempt's file for what it is). Without it, only ``name``, ``generation``
            and ``world_size`` tell launches apart (docs/design.md §13).
        attach_timeout_s: how long each rank waits for the others to arrive and map the pool; then
            every rank that arrived fails with :class:`~kvoffload.errors.PoolTimeoutError` naming
            the ranks that did not.

    Raises (at construction):
        ArgumentTypeError, InvalidArgumentError: a malformed name, world size, generation, launch
            or timeout.
    """

    name: str = attrs.field(validator=_check_name)
    world_size: int = attrs.field(validator=_check_world)
    generation: int = attrs.field(default=0, kw_only=True, validator=_check_generation)
    attach_timeout_s: float = attrs.field(
        default=DEFAULT_ATTACH_TIMEOUT_S, kw_only=True, validator=_check_timeout
    )
    launch: str | None = attrs.field(default=None, kw_only=True, validator=_check_launch)

    @property
    def launch_digest(self) -> bytes:
        """What the pool's header records of :attr:`launch` (16 bytes; all zeros for None)."""
        if self.launch is None:
            return NO_LAUNCH
        return hashlib.blake2b(self.launch.encode("utf-8", "surrogatepass"), digest_size=16,
                               person=b"kvoffload-launch").digest()

    def rank(self, rank: int) -> PoolRank:
        """What rank ``rank`` passes to ``Worker.create(..., shared=...)``.

        Raises:
            ArgumentTypeError, InvalidArgumentError: ``rank`` not an int in ``[0, world_size)``.
        """
        return PoolRank(self, rank)

    @staticmethod
    def inspect(name: str, *, pid: int | None = None, writable: bool = False) -> PoolView:
        """Map the whole pool called ``name`` (every rank's slices) for a test or an operator.

        While the ranks attach (or when a stale file is left) the pool is the file under
        ``/dev/shm``; once they all mapped it the name is gone, and the pool is found through a
        process that holds it (``pid``, else every process of this user, this one first). The
        returned :class:`~kvoffload.pool.view.PoolView` owns its mapping: ``close()`` it. With
        ``writable`` its arrays are writable (tests fill other ranks' slices with a pattern).

        Raises:
            InvalidArgumentError: a malformed name, or a ``pid`` that is not a positive int.
            ArgumentTypeError: ``pid`` not an int, ``writable`` not a bool.
            RegionError: no such pool (no file, no process holding one), or a file that is not a
                kvoffload pool.
        """
        from kvoffload.pool.view import PoolView

        if pid is not None:
            _check_int("pid", pid, 1, 1 << 22)  # Linux's pid_max at most
        if not isinstance(writable, bool):
            raise ArgumentTypeError(f"writable = {writable!r} must be a bool")
        return PoolView.open(check_pool_name(name), pid=pid, writable=writable)


@attrs.frozen
class PoolRank:
    """One rank of a :class:`SharedPool` (from ``pool.rank(r)``): what ``Worker.create(...,
    shared=...)`` takes."""

    pool: SharedPool
    rank: int

    def __attrs_post_init__(self) -> None:
        """Checked here, so that a rank built by hand is refused before anything is attached (a
        rank of -1 took the last rank's place in the pool's header).

        Raises:
            ArgumentTypeError: ``pool`` not a :class:`SharedPool`, ``rank`` not an int.
            InvalidArgumentError: ``rank`` not in ``[0, world_size)``.
        """
        if not isinstance(self.pool, SharedPool):
            raise ArgumentTypeError(f"pool must be a SharedPool, got {type(self.pool).__name__}")
        _check_int("rank", self.rank, 0, self.pool.world_size - 1)

    @property
    def name(self) -> str:
        """The pool's name."""
        return self.pool.name

    @property
    def world_size(self) -> int:
        """The pool's number of ranks."""
        return self.pool.world_size
