"""The exception hierarchy of kvoffload.

Every error the library raises on purpose derives from :class:`KVOffloadError`. Errors that mean
"you called it wrong" also derive from the matching builtin (``ValueError``, ``TypeError``,
``KeyError``, ``TimeoutError``) so that generic handlers keep working. Errors that mean "it broke"
(:class:`CudaError`, :class:`TransferError`, :class:`ShutdownError`) do not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "ArgumentTypeError",
    "BlockConflictError",
    "BlockIdTypeError",
    "ClosedError",
    "CudaError",
    "DeviceMismatchError",
    "DiskError",
    "DiskFormatError",
    "DiskInUseError",
    "DiskIOError",
    "DiskIntegrityError",
    "DiskPathError",
    "DiskShutdownError",
    "DuplicateKeyError",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "JobIdError",
    "KVOffloadError",
    "KeyStateError",
    "KeyTypeError",
    "LayerError",
    "LayoutError",
    "MissingDependencyError",
    "NativeBuildError",
    "PolicyError",
    "PoolCollisionError",
    "PoolMismatchError",
    "PoolRankFailedError",
    "PoolTimeoutError",
    "RegionError",
    "RemoteError",
    "RemoteIntegrityError",
    "RemoteMissError",
    "RemoteShutdownError",
    "RemoteStoreError",
    "RemoteTimeoutError",
    "RemoteUnavailableError",
    "SharedPoolError",
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


class LayerError(LayoutError):
    """Raised when the layout's layers cannot be described (``DeviceLayout.from_tensors(...,
    layers=..., layer_dim=...)``): a tensor, or an index of a tensor's layer dim, in two layers or in
    none, an empty layer, an unknown name or index, aliased bytes in two layers, a layer's slice of a
    page that is not 16-byte aligned; and by ``Worker.load_by_layer`` when the layout has no layers
    because the tensor names do not say them (the message says why and what to pass).
    """


class MissingDependencyError(KVOffloadError, ImportError):
    """Raised when a feature needs an optional dependency that is not installed; the message names
    the extra to install (``pip install 'kvoffload[cuda]'`` for the GPU paths)."""


class NativeBuildError(KVOffloadError):
    """Raised when the native issuer cannot be built or loaded (no C compiler, a compile error: the
    message carries the compiler's output). A worker created with ``issuer="auto"`` then issues from
    Python instead; ``issuer="native"`` raises it from ``Worker.create``."""


class RegionError(KVOffloadError):
    """Raised when the host region cannot be created or attached (mapping, file or pinning failed).

    Everything acquired before the failure has been released when it is raised.
    """


class SharedPoolError(RegionError):
    """Base of the errors of attaching a shared host pool (``kvoffload.SharedPool``, one mapping that
    every tensor-parallel rank maps): ``pool`` is the pool's name, ``ranks`` the ranks the error is
    about. Raised by ``Worker.create(..., shared=...)`` on every rank that takes part, with the same
    ranks named on each; nothing of the attach is left mapped, pinned or in ``/dev/shm``.
    """

    def __init__(self, message: str, *, pool: str, ranks: Sequence[int] = ()) -> None:
        self.pool = pool
        self.ranks: tuple[int, ...] = tuple(ranks)
        super().__init__(message)


class PoolTimeoutError(SharedPoolError, TimeoutError):
    """Raised when a shared pool's attach deadline (``SharedPool.attach_timeout_s``) passed before every
    rank arrived (or had mapped the pool): ``ranks`` are the ranks that did not."""


class PoolMismatchError(SharedPoolError):
    """Raised when the ranks of one shared pool disagree on its geometry: every rank's host record
    size (``DeviceLayout.record_bytes``) and record count (``num_host_blocks`` plus the disk tier's
    bounce slots) must be equal. ``ranks`` are the ranks that differ from rank 0; the message gives
    every rank's values."""


class PoolCollisionError(SharedPoolError):
    """Raised when a shared pool's name is held by a live pool that is not this one: another engine
    (another ``generation`` or ``world_size``) is attaching under the same name, or this rank was
    already taken by a live process. ``ranks`` are the ranks held by live processes; ``pids`` their
    process ids. Nothing of the other pool is touched."""

    def __init__(
        self, message: str, *, pool: str, ranks: Sequence[int] = (), pids: Sequence[int] = ()
    ) -> None:
        self.pids: tuple[int, ...] = tuple(pids)
        super().__init__(message, pool=pool, ranks=ranks)


class PoolRankFailedError(SharedPoolError):
    """Raised when a rank of a shared pool died (its process is gone) or gave up (an error of its
    own, such as a failed registration) while the pool was being attached: ``ranks`` are those
    ranks. The attach cannot complete, so every other rank fails too."""


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
    """Raised when a pluggable eviction policy broke its contract. Two ways:

    * it proposed a victim that is not evictable (pending, loading, protected by the request,
      unknown) or more victims than asked: the manager refused the plan and changed nothing;
    * it raised from a notification (``admit``, ``hit``, ``hold``, ``release``, ``evict``,
      ``clear``): the manager's own change was made whole first (its other notifications were
      still made) and stands; ``result`` is what the call returned (a plan to complete, or None),
      and the exception is the ``__cause__``. The policy may have missed that notification.

    This is an "it broke" error of the policy.
    """

    def __init__(self, message: str, result: object = None) -> None:
        self.result = result
        super().__init__(message)


class DiskError(KVOffloadError):
    """Base of the disk tier's errors that say something about the file or the disk broke.

    ``kind`` names the failure in one word (the values of ``kvoffload.disk.DiskErrorKind``, e.g.
    ``"eio"``, ``"checksum_mismatch"``, ``"fingerprint_mismatch"``), ``path`` is the tier's file,
    ``blocks`` the disk blocks concerned (empty when the failure is about the whole file) and
    ``errno`` the operating system's error number when a system call failed. Raised as such only when
    ``DiskConfig(direct=True)`` asks for O_DIRECT and the file system refuses it; the subclasses say
    the rest.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        path: str = "",
        blocks: Sequence[int] = (),
        errno: int | None = None,
    ) -> None:
        self.kind = kind
        self.path = path
        self.blocks: tuple[int, ...] = tuple(blocks)
        self.errno = errno
        super().__init__(message)


class DiskIOError(DiskError, TransferError):
    """Carried in a disk job's ``TransferResult.error`` (``ok=False``) when a read or write system call
    failed or moved fewer bytes than asked: ``kind`` is ``"short_read"`` (e.g. a truncated file),
    ``"short_write"``, ``"eio"``, ``"enospc"`` or ``"os_error"`` (any other errno). Also raised by
    ``DiskTier.create`` when the file cannot be opened, sized or initialised (nothing is left open).
    A failed write leaves its disk records invalid; a failed read zero-fills its destination records.
    """


class DiskIntegrityError(DiskError, TransferError):
    """Carried in a disk read's ``TransferResult.error`` (``ok=False``) when a record read back does not
    verify: ``"checksum_mismatch"`` (the payload is not the bytes that were written: a torn write, a
    flipped bit), ``"header_invalid"`` (no valid record header: never written, torn, or another file's
    record), ``"block_mismatch"`` (the header names another disk block: never served as this one),
    ``"generation_mismatch"`` (an older or newer write than the index expects) or ``"not_valid"`` (the
    index holds no valid record for the block: never written, or its last write failed). The
    destination records of the failed blocks are zero-filled and the disk records dropped from the
    index.
    """


class DiskFormatError(DiskError):
    """Raised by ``DiskTier.create`` when an existing file cannot be reused as asked: it is not a
    kvoffload disk tier (``"not_a_tier"``; such a file is never overwritten), it has another format
    version (``"version_mismatch"``), another layout fingerprint (``"fingerprint_mismatch"``), another
    record size or block count (``"geometry_mismatch"``), or a damaged file header
    (``"header_invalid"``). With ``DiskConfig(recreate=True)`` a tier file of another version,
    fingerprint or geometry is recreated instead. Nothing is left open when it is raised.
    """


class DiskInUseError(DiskError):
    """Raised by ``DiskTier.create`` (kind ``"in_use"``) when another open tier, in this process or
    another, holds the file: two tiers on one file would write records the other's index then serves
    as its own. The holder's lock goes when its tier shuts down or its process exits. Nothing is left
    open when it is raised.
    """


class DiskPathError(InvalidArgumentError):
    """Raised by ``DiskTier.create`` when ``DiskConfig.path`` cannot hold a tier file: it is a
    directory, its parent directory does not exist or is not a directory, it is not a regular file,
    or it cannot be opened for reading and writing (the message gives the operating system's reason).
    """


class DiskShutdownError(ShutdownError):
    """Raised by ``DiskTier.shutdown`` after all cleanup ran, carrying every failure (a drain that
    passed its deadline, an I/O thread that did not stop, a failing ``close``).

    ``fd_left_open`` is true when the file descriptor was deliberately kept open because an I/O thread
    did not stop in time and may still be inside a system call on it (closing it could let the thread
    read or write a file opened later under the same number). The host records such a thread reads or
    writes are then still in use too: the region holding them must not be unmapped.
    """

    def __init__(
        self, message: str, failures: Sequence[BaseException] = (), *, fd_left_open: bool = False
    ) -> None:
        self.fd_left_open = fd_left_open
        if fd_left_open:
            message += (
                " (the disk file descriptor was kept open: an I/O thread did not stop and may still "
                "use it and the host records)"
            )
        super().__init__(message, failures)


class RemoteError(KVOffloadError):
    """Base of the remote tier's errors that say something about the store or a record broke.

    ``kind`` names the failure in one word (the values of ``kvoffload.remote.RemoteErrorKind``, e.g.
    ``"not_found"``, ``"checksum_mismatch"``, ``"timeout"``), ``keys`` are the block keys concerned
    and ``code`` is the store client's own status code when it gave one. The subclasses say when
    each kind is used; a remote call carries them in its result, one per failed key. The error of a
    Worker's remote job names every failed key; its class and ``kind`` are the first failed key's,
    and ``kinds`` counts the failed keys of each kind (``{kind: len(keys)}`` for one kind).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        keys: Sequence[bytes] = (),
        code: int | None = None,
        kinds: Mapping[str, int] | None = None,
    ) -> None:
        self.kind = kind
        self.keys: tuple[bytes, ...] = tuple(keys)
        self.code = code
        self.kinds: Mapping[str, int] = dict(kinds) if kinds is not None else {kind: max(1, len(self.keys))}
        super().__init__(message)


class RemoteMissError(RemoteError, TransferError):
    """A get found no record under the key (``"not_found"``): never stored, evicted, or removed.

    A clean miss: nothing was served, and the host row was zero-filled.
    """


class RemoteIntegrityError(RemoteError, TransferError):
    """A record read back did not verify, and was not served (its host row was zero-filled).

    Kinds: ``"size_mismatch"`` (the stored value is not one header page plus one host record of this
    layout), ``"header_invalid"`` (no record header, a header whose CRC32 fails, another format
    version, a header that is not a remote record's), ``"fingerprint_mismatch"`` (written by an
    instance with another layout), ``"key_mismatch"`` (the header names another key),
    ``"generation_mismatch"`` (another write of the key than the caller expects) and
    ``"checksum_mismatch"`` (the payload is not the bytes that were written).
    """


class RemoteTimeoutError(RemoteError, TransferError):
    """The call's deadline passed before the key's operation finished (``"timeout"``).

    ``settled`` is False when the store client was still inside the operation at the deadline: it may
    still read (a put) or write (a get) the host rows of the call until the store reports it idle
    (``wait_idle``); the rows of such a get are zero-filled once the operation returns.
    """

    def __init__(
        self,
        message: str,
        *,
        keys: Sequence[bytes] = (),
        settled: bool = True,
        code: int | None = None,
        kinds: Mapping[str, int] | None = None,
    ) -> None:
        self.settled = settled
        super().__init__(message, kind="timeout", keys=keys, code=code, kinds=kinds)


class RemoteUnavailableError(RemoteError, TransferError):
    """The store could not be reached or did not answer (``"unavailable"``: refused connection,
    failed RPC, a server that went away), or the store was closed before the operation started
    (``"closed"``). Also raised by ``create`` when the store cannot be joined (nothing is left open).
    """


class RemoteStoreError(RemoteError, TransferError):
    """The store answered, but refused or failed the operation: ``"store_full"`` (no space and
    nothing it may evict), ``"transfer_failed"`` (its data transfer failed) or ``"rejected"`` (any
    other status; ``code`` holds it)."""


class RemoteShutdownError(ShutdownError):
    """Raised by a remote store's ``close`` after all cleanup ran, carrying every failure.

    ``client_left_open`` is true when an operation was still running inside the store client at the
    deadline: the client (and its registration of the host rows) was deliberately not closed, since
    closing it under a running call could let that call touch freed memory; the store releases it
    when that call returns (``wait_idle`` tells). Until then the host rows are still in use and must
    not be unmapped.
    """

    def __init__(
        self, message: str, failures: Sequence[BaseException] = (), *, client_left_open: bool = False
    ) -> None:
        self.client_left_open = client_left_open
        if client_left_open:
            message += (
                " (the store client was left open: an operation was still running in it and may "
                "still use the host rows; it is released when that operation returns)"
            )
        super().__init__(message, failures)


def warn_on_del(released_flag: str, message: str) -> Callable[[object], None]:
    """A ``__del__`` for an owner: a ``ResourceWarning`` when ``owner.<released_flag>`` is False (it
    was never closed). It releases nothing (no cleanup runs in a finalizer) and says nothing while
    the interpreter shuts down (the warning function is bound here, not looked up then)."""
    warn = warnings.warn

    def __del__(owner: object) -> None:
        try:
            if not getattr(owner, released_flag, True):
                warn(message, ResourceWarning, stacklevel=2)
        except Exception:  # interpreter shutdown: the warnings machinery may already be gone
            pass

    return __del__
