"""The exception hierarchy of kvoffload.

Every error the library raises on purpose derives from :class:`KVOffloadError`. Errors that mean
"you called it wrong" also derive from the matching builtin (``ValueError``, ``TypeError``,
``KeyError``, ``TimeoutError``) so that generic handlers keep working. Errors that mean "it broke"
(:class:`CudaError`, :class:`TransferError`, :class:`ShutdownError`) do not.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ArgumentTypeError",
    "BlockConflictError",
    "BlockIdTypeError",
    "ClosedError",
    "CudaError",
    "DeviceMismatchError",
    "DuplicateKeyError",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "JobIdError",
    "KVOffloadError",
    "KeyStateError",
    "KeyTypeError",
    "LayoutError",
    "PolicyError",
    "RegionError",
    "ShutdownError",
    "TransferError",
    "UnknownJobError",
    "UnknownKeyError",
    "UnknownPolicyError",
    "WaitTimeoutError",
]


class KVOffloadError(Exception):
    """Base class of every error kvoffload raises on purpose."""


class ClosedError(KVOffloadError):
    """Raised when an object is used after its ``shutdown()``/``cleanup()`` was called.

    This is a "you closed it" error: the object was released deliberately. It is separate from the
    errors that say something broke.
    """


class CudaError(KVOffloadError):
    """Raised when a CUDA driver call returns an error.

    Carries the name of the call, the numeric result, the driver's error name and message, so a log
    line alone says what failed: ``cuMemHostRegister failed: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    (712): part or all of the requested memory range is already mapped``.
    """

    def __init__(self, call: str, code: int, name: str, message: str) -> None:
        self.call = call
        self.code = code
        self.name = name
        self.message = message
        super().__init__(f"{call} failed: {name} ({code}): {message}")


class TransferError(KVOffloadError):
    """Raised (or carried in ``TransferResult.error``) when a copy could not be issued or completed.

    A job whose copy failed is reported with ``ok=False``; its destination blocks hold undefined bytes
    and must not be treated as valid.
    """


class LayoutError(KVOffloadError, ValueError):
    """Raised when the engine's device tensors cannot be described as a block layout.

    The message names the tensor and the rule it breaks (mixed devices, different block counts, a page
    that is not contiguous, a misaligned page, zero blocks, a block dim out of range, overlapping
    tensors).
    """


class RegionError(KVOffloadError):
    """Raised when the host region cannot be created or attached (mapping, file or pinning failed).

    Everything acquired before the failure has been released when it is raised.
    """


class ShutdownError(KVOffloadError):
    """Raised by ``shutdown()``/``cleanup()`` after all cleanup ran, carrying every failure it met.

    ``failures`` lists the collected exceptions in the order they happened. ``region_left_mapped`` is
    true when the host region was deliberately not unmapped because the device could not be proven
    idle (unmapping memory a DMA engine may still write is worse than a leak).
    """

    def __init__(
        self,
        message: str,
        failures: Sequence[BaseException] = (),
        *,
        region_left_mapped: bool = False,
    ) -> None:
        self.failures: tuple[BaseException, ...] = tuple(failures)
        self.region_left_mapped = region_left_mapped
        details = "; ".join(f"{type(f).__name__}: {f}" for f in self.failures)
        text = message if not details else f"{message} [{details}]"
        if region_left_mapped:
            text += " (the host region was left mapped: the device could not be proven idle)"
        super().__init__(text)


class InvalidArgumentError(KVOffloadError, ValueError):
    """Raised when an argument has the right type but a value the call cannot accept."""


class InvalidBlockIdError(InvalidArgumentError):
    """Raised when block ids are malformed: unequal lengths, negative, out of range, duplicated
    destinations, or not integers (then it is also a ``TypeError``; see :class:`BlockIdTypeError`)."""


class BlockIdTypeError(InvalidBlockIdError, TypeError):
    """Raised when block ids are not integers (floats, bools, strings, nested sequences)."""


class JobIdError(InvalidArgumentError):
    """Raised when a job id is not an ``int``, or is already in flight or waiting to be polled."""


class BlockConflictError(InvalidArgumentError):
    """Raised when a job would read a block an in-flight job writes, or write a block an in-flight job
    reads or writes. Submit it again after the conflicting job completed (see ``poll``/``wait``)."""


class DeviceMismatchError(InvalidArgumentError):
    """Raised when a device or stream argument is on a different device than the layout."""


class UnknownJobError(KVOffloadError, KeyError):
    """Raised by ``wait`` for a job id that is neither in flight nor finished-and-unpolled."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class WaitTimeoutError(KVOffloadError, TimeoutError):
    """Raised by ``wait`` when its deadline passes; ``pending`` names the jobs still unfinished.

    The jobs stay in flight; a later ``poll`` or ``wait`` reports them.
    """

    def __init__(self, message: str, pending: Sequence[int] = ()) -> None:
        self.pending: tuple[int, ...] = tuple(pending)
        super().__init__(message)


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """Raised when an argument has the wrong type (a pool size that is not an ``int``, a flag that is
    not a ``bool``, a plan of the wrong kind). It is both an :class:`InvalidArgumentError` and a
    ``TypeError``."""


class KeyTypeError(ArgumentTypeError):
    """Raised when a block key is not ``bytes`` (a ``str``, ``None``, an ``int``), or when a single key
    is passed where a sequence of keys is expected. The message names the argument and the index."""


class DuplicateKeyError(InvalidArgumentError):
    """Raised when one call names the same block key twice where that is ambiguous (a key would get two
    host blocks, or two load references that one completion could not tell apart)."""


class UnknownKeyError(KVOffloadError, KeyError):
    """Raised when a key is not part of what the call refers to: a key to complete that is not in the
    plan, or a key to load that the manager does not hold in any tier."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class KeyStateError(InvalidArgumentError):
    """Raised when a known key is in the wrong state for the call: loading a key whose store has not
    completed, completing a store or demotion twice, completing a load that has no outstanding
    ``prepare_load``. Nothing changed when it is raised."""


class UnknownPolicyError(InvalidArgumentError):
    """Raised when an eviction policy name is not one the manager knows; the message lists the names."""


class PolicyError(KVOffloadError):
    """Raised when a pluggable eviction policy broke its contract: it proposed a victim that is not
    evictable (pending, loading, protected by the request, unknown) or more victims than asked. This is
    an "it broke" error of the policy; the manager refused the plan and changed nothing."""
