"""Assembly: builds what a Worker is made of, from the arguments of ``Worker.create``.

Owns nothing once it returns: every part it built is handed, in a :class:`WorkerParts`, to the
worker that owns it from then on; on any failure the parts built so far are released in reverse
order (an undo list) and nothing is left mapped, pinned, running or open. It is the one place that
knows how the layers fit together: the region, one handler per direction (each over a backend of
the chosen kind, composed of its transfer paths), the calibration of ``auto`` (fed with the same
components), the disk tier with its pipeline and bounce handlers, and the remote tier.

The lowest layer is injected: ``backend_factory`` replaces the host or CUDA backend of every
handler (both directions, and the disk pipeline's bounce handlers), ``pinner`` the host registration (tests use them; so can an integrator who brings its
own copy engine). The CUDA layers (``kvoffload.bindings``, the CUDA backend and its paths) are
imported only when a CUDA worker is built, so a host-only worker runs without cuda-python.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs
import numpy as np
import torch

from kvoffload import calibration
from kvoffload._descriptors import CopyPlan
from kvoffload._jobs import JobBook
from kvoffload.backends.host import HostBackend
from kvoffload.bindings.pinning import PIN_CHUNK_BYTES, HostPinner, NoPinner
from kvoffload.disk.config import DiskConfig
from kvoffload.worker.pipeline import DiskPipeline
from kvoffload.disk.tier import DiskTier
from kvoffload.errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    InvalidArgumentError,
    KVOffloadError,
    MissingDependencyError,
)
from kvoffload.handler import Backend, DirectionHandler
from kvoffload.layout import RECORD_ALIGN_BYTES, DeviceLayout
from kvoffload.pool import PoolRank, SharedPool
from kvoffload.pool.spec import check_pool_name
from kvoffload.records import Direction
from kvoffload.region import RegionOwner
from kvoffload.remote.config import RemoteConfig
from kvoffload.remote.tier import RemoteTier

_log = logging.getLogger("kvoffload.worker")

if TYPE_CHECKING:
    from kvoffload.backends.cuda import CudaBackend, CudaStreams, TransferPath
    from kvoffload.bindings.copier import Copier
    from kvoffload.bindings.driver import Capabilities

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "BackendName",
    "PathName",
    "WorkerOptions",
    "WorkerParts",
    "assemble",
]

BackendName = Literal["auto", "cuda", "host"]
PathName = Literal["auto", "dma", "staged", "sm"]
IssuerName = Literal["auto", "native", "python"]
#: ``direction -> backend``: builds a direction's backend in place of the host or CUDA one.
BackendFactory = Callable[[Direction], Backend]
_BACKENDS: Final = ("auto", "cuda", "host")
_PATHS: Final = ("auto", "dma", "staged", "sm")
#: Device memory for the staged path's rings, both directions together.
DEFAULT_STAGING_BYTES: Final = 256 << 20
DEFAULT_STAGING_SLOTS: Final = 2
#: Pinned bounce memory for device <-> disk jobs: each half holds several disk requests, so that the
#: tier's I/O threads read in parallel (64 MiB is 32 records of 2 MiB).
DEFAULT_BOUNCE_BYTES: Final = 64 << 20
MIN_BOUNCE_SLOTS: Final = 4
MAX_BOUNCE_SLOTS: Final = 256
#: Time a failed ``create`` gives the parts it already started to stop.
CREATE_ROLLBACK_TIMEOUT_S: Final = 10.0
#: How long calibration gives one of its scratch handlers to stop.
_CALIBRATION_STOP_S: Final = 60.0


@attrs.frozen
class WorkerOptions:
    """The keyword arguments of ``Worker.create`` (documented there), validated by :func:`assemble`."""

    device: torch.device | str | None = None
    backend: str = "auto"
    shared: PoolRank | None = None
    shared_name: str | None = None
    copy_method: object = None
    pin_chunk_bytes: int = PIN_CHUNK_BYTES
    path: str = "auto"
    staging_bytes: int = DEFAULT_STAGING_BYTES
    staging_slots: int = DEFAULT_STAGING_SLOTS
    kernel_ctas: int | None = None
    calibration_path: str | None = None
    disk: DiskConfig | None = None
    bounce_slots: int | None = None
    remote: RemoteConfig | None = None
    check_memory: bool = True
    backend_factory: BackendFactory | None = None
    pinner: HostPinner | None = None
    issuer: str = "auto"
    expedited_loads: bool = False
    expedited_path: str | None = None
    #: Set on the expedited lane's own options only (``_expedited_options``): its loads of at most
    #: this many bytes go through ``sm`` where the device addresses the pool as is; 0: none.
    lane_sm_bytes: int = 0
    #: Set on the expedited lane's own options only: the regular lanes' options, whose calibration
    #: (``auto``) the lane shares (the lane's smaller ring must not time ``staged`` for them).
    regular: WorkerOptions | None = None


@attrs.frozen(eq=False)
class WorkerParts:
    """What :func:`assemble` built, handed to the worker that owns it from then on."""

    layout: DeviceLayout
    region: RegionOwner
    store_handler: DirectionHandler
    load_handler: DirectionHandler
    book: JobBook
    backend_name: str
    device_sync: Callable[[float], bool]
    num_host_blocks: int
    capabilities: Capabilities | None = None
    tier: DiskTier | None = None
    bounce: tuple[DirectionHandler, DirectionHandler] | None = None
    pipeline: DiskPipeline | None = None
    remote: RemoteTier | None = None
    issuer: str = "python"
    #: The second load lane (``Worker.create(expedited_loads=True)``): loads with its own backend,
    #: so that they never queue behind the regular lane's in the library (docs/design.md §4).
    expedited_handler: DirectionHandler | None = None


def assemble(layout: DeviceLayout, num_host_blocks: int, options: WorkerOptions) -> WorkerParts:
    """Validate every argument, then build the parts; on any failure release what was built.

    Raises: as ``Worker.create``.
    """
    if not isinstance(layout, DeviceLayout):
        raise ArgumentTypeError(
            f"layout must be a DeviceLayout (from DeviceLayout.from_tensors), got {type(layout).__name__}"
        )
    if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int):
        raise ArgumentTypeError(
            f"num_host_blocks = {num_host_blocks!r} must be a positive int, not a "
            f"{type(num_host_blocks).__name__}"
        )
    if num_host_blocks <= 0:
        raise InvalidArgumentError(f"num_host_blocks = {num_host_blocks} must be a positive int")
    o = options
    chosen = _choose_backend(layout, o.backend, o.device)
    _check_copy_method_backend(o.copy_method, chosen)
    _check_path(o.path, chosen, o.staging_bytes, o.staging_slots, o.kernel_ctas)
    _check_issuer(o.issuer, chosen, o.copy_method)
    if o.disk is not None and not isinstance(o.disk, DiskConfig):
        raise ArgumentTypeError(f"disk must be a DiskConfig or None, got {type(o.disk).__name__}")
    slots = _bounce_slots(o.bounce_slots, layout.record_bytes)  # checked with or without a disk tier
    if o.disk is None:
        slots = 0
    if (num_host_blocks + slots) * layout.record_bytes > sys.maxsize:  # past what mmap can be asked
        raise InvalidArgumentError(
            f"num_host_blocks = {num_host_blocks}: a host pool of {num_host_blocks + slots} records of "
            f"{layout.record_bytes} bytes is past the {sys.maxsize} bytes a mapping can have"
        )
    if o.remote is not None and not isinstance(o.remote, RemoteConfig):
        raise ArgumentTypeError(f"remote must be a RemoteConfig or None, got {type(o.remote).__name__}")
    if isinstance(o.pin_chunk_bytes, bool) or not isinstance(o.pin_chunk_bytes, int):
        raise ArgumentTypeError(
            f"pin_chunk_bytes = {o.pin_chunk_bytes!r} must be a positive int, not a "
            f"{type(o.pin_chunk_bytes).__name__}"
        )
    if o.pin_chunk_bytes <= 0:
        raise InvalidArgumentError(f"pin_chunk_bytes = {o.pin_chunk_bytes} must be a positive int")
    if not isinstance(o.check_memory, bool):
        raise ArgumentTypeError(f"check_memory = {o.check_memory!r} must be a bool")
    if not isinstance(o.expedited_loads, bool):
        raise ArgumentTypeError(f"expedited_loads = {o.expedited_loads!r} must be a bool")
    _check_expedited_path(o.expedited_path, o.expedited_loads, chosen, o.backend_factory is not None)
    if o.backend_factory is not None and not callable(o.backend_factory):
        raise ArgumentTypeError(f"backend_factory = {o.backend_factory!r} must be callable or None")
    if o.pinner is not None and not all(
        callable(getattr(o.pinner, name, None)) for name in ("register", "unregister")
    ):
        raise ArgumentTypeError(
            f"pinner = {o.pinner!r:.80} must have register(ptr, nbytes) and unregister(ptr) "
            "(a HostPinner) or be None"
        )
    if o.calibration_path is not None and not isinstance(o.calibration_path, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"calibration_path = {o.calibration_path!r} must be a path (str or os.PathLike) or None"
        )
    shared = _shared_rank(o.shared, o.shared_name)
    if o.remote is not None and shared is not None and shared.world_size > 1:
        raise InvalidArgumentError(
            f"a remote tier over a pool shared by {shared.world_size} ranks is not supported: each "
            "rank's host records are slices of the pool's blocks, and the remote tier stores whole "
            "records of one process; give the remote tier to workers with a pool of their own"
        )
    cuda = _cuda_parts(layout, o.copy_method) if chosen == "cuda" else None
    with contextlib.ExitStack() as undo:
        pinner = o.pinner if o.pinner is not None else (cuda.pinner if cuda else NoPinner())
        if shared is None:
            region = RegionOwner.create(
                num_records=num_host_blocks + slots, record_bytes=layout.record_bytes, pinner=pinner,
                chunk_bytes=o.pin_chunk_bytes, check_memory=o.check_memory,
            )
        else:
            region = RegionOwner.attach_shared(
                shared, num_records=num_host_blocks + slots, record_bytes=layout.record_bytes,
                pinner=pinner, chunk_bytes=o.pin_chunk_bytes, check_memory=o.check_memory,
            )
        undo.callback(region.cleanup)
        undo.push(_drop_failed_frames)  # runs first: the region's views in them are not the caller's
        book = JobBook()
        handlers = []
        lanes = [
            (Direction.STORE, layout.num_blocks, num_host_blocks, o),
            (Direction.LOAD, num_host_blocks, layout.num_blocks, o),
        ]
        lane = _expedited_options(o, layout, _mapped(cuda, region)) if o.expedited_loads else None
        if lane is not None:  # the second load lane: a backend (streams, thread) of its own
            lanes.append((Direction.LOAD, num_host_blocks, layout.num_blocks, lane))
        for direction, num_src, num_dst, lane_options in lanes:
            plan = CopyPlan(layout.page_table, region.base_ptr, region.chunk_records, direction,
                            host_stride=region.record_stride)
            if o.backend_factory is not None:
                backend = _made_backend(o.backend_factory, direction)
            elif cuda is not None:
                backend = _issuing(_cuda_backend(direction, layout, region, cuda, lane_options, o.issuer),
                                   cuda, o.issuer)
            else:
                backend = HostBackend(direction)
            native_issuer = bool(getattr(backend, "hands_off", False))
            handlers.append(_handler_over(backend, undo, plan, num_src, num_dst, book))
        tier: DiskTier | None = None
        bounce: tuple[DirectionHandler, DirectionHandler] | None = None
        pipeline: DiskPipeline | None = None
        if o.disk is not None:
            tier = DiskTier.create(o.disk, fingerprint=layout.fingerprint,
                                   record_bytes=layout.record_bytes, records=region.records(), book=book)
            undo.callback(tier.shutdown, CREATE_ROLLBACK_TIMEOUT_S)
            bounce = _bounce_handlers(layout, region, cuda, o.backend_factory, undo)
            pipeline = DiskPipeline.create(
                to_slots=bounce[0], from_slots=bounce[1], tier=tier,
                slot_rows=np.arange(num_host_blocks, num_host_blocks + slots, dtype=np.int64),
                block_bytes=layout.block_bytes, book=book,
            )
            undo.callback(pipeline.shutdown, CREATE_ROLLBACK_TIMEOUT_S)
        remote: RemoteTier | None = None
        if o.remote is not None:
            remote = RemoteTier.create(o.remote, host_rows=region.records()[:num_host_blocks],
                                       fingerprint=layout.fingerprint, book=book)
            undo.callback(remote.shutdown, CREATE_ROLLBACK_TIMEOUT_S)
        parts = WorkerParts(
            layout=layout, region=region, store_handler=handlers[0], load_handler=handlers[1],
            book=book, backend_name=chosen, num_host_blocks=num_host_blocks,
            device_sync=cuda.device_sync if cuda is not None else _host_sync,
            capabilities=cuda.capabilities if cuda is not None else None,
            tier=tier, bounce=bounce, pipeline=pipeline, remote=remote,
            issuer="native" if native_issuer else "python",
            expedited_handler=handlers[2] if lane is not None else None,
        )
        undo.pop_all()
    return parts


# ------------------------------------------------------------------------------------ arguments


def _choose_backend(
    layout: DeviceLayout, backend: str, device: torch.device | str | None
) -> Literal["cuda", "host"]:
    if not isinstance(backend, str):
        raise ArgumentTypeError(f"backend = {backend!r} must be a str, not a {type(backend).__name__}")
    if backend not in _BACKENDS:
        raise InvalidArgumentError(f"backend = {backend!r} must be one of {', '.join(_BACKENDS)}")
    if device is not None:
        try:
            wanted = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise DeviceMismatchError(f"device = {device!r} is not a torch device: {exc}") from exc
        index: int | None = wanted.index
        if wanted.type == "cuda" and index is None and layout.device.type == "cuda":
            wanted = torch.device("cuda", _index(wanted))
        if wanted != layout.device:
            raise DeviceMismatchError(
                f"device = {wanted} but the layout's tensors are on {layout.device}"
            )
    kind = layout.device.type
    if backend == "auto":
        if kind == "cuda":
            return "cuda"
        if kind == "cpu":
            return "host"
        raise DeviceMismatchError(f"no backend for tensors on {layout.device}")
    if backend == "cuda" and kind != "cuda":
        raise DeviceMismatchError(f"backend 'cuda' needs CUDA tensors; the layout is on {layout.device}")
    if backend == "host" and kind != "cpu":
        raise DeviceMismatchError(f"backend 'host' needs CPU tensors; the layout is on {layout.device}")
    return "cuda" if backend == "cuda" else "host"


#: The ``issuer`` choices of ``Worker.create``.
_ISSUERS: Final = ("auto", "native", "python")


def _check_issuer(issuer: object, backend: str, copy_method: object) -> None:
    if not isinstance(issuer, str):
        raise ArgumentTypeError(f"issuer = {issuer!r} must be a str, not a {type(issuer).__name__}")
    if issuer not in _ISSUERS:
        raise InvalidArgumentError(f"issuer = {issuer!r} must be one of {', '.join(_ISSUERS)}")
    if issuer == "native" and backend != "cuda":
        raise InvalidArgumentError(f"issuer = 'native' applies to the cuda backend only (backend is {backend!r})")
    if issuer == "native" and str(getattr(copy_method, "value", copy_method)) == "batch-bindings":
        raise InvalidArgumentError(
            "issuer = 'native' calls the driver itself: copy_method 'batch-bindings' (a cross-check "
            "of the Python call path) needs issuer = 'python'"
        )


def _issuing(inner: CudaBackend, cuda: _Cuda, issuer: str) -> Backend:
    """``inner`` issued by the native thread (``issuer`` "native", or "auto" where the library
    builds and the copy method allows it), or as it is ("python"; "auto" otherwise, with a warning
    that says why). ``inner`` is released if "native" fails."""
    if not _tries_native(cuda, issuer):
        return inner
    from kvoffload.backends.native import NativeBackend

    try:
        return NativeBackend.over(inner, cuda.copier)
    except KVOffloadError as exc:
        if issuer == "native":
            inner.release()
            raise
        _log.warning("the native issuer is not available (%s): jobs are issued from Python", exc)
        return inner


def _tries_native(cuda: _Cuda, issuer: str) -> bool:
    """Whether ``issuer`` asks for the native issuer here: "native", or "auto" unless the copy
    method is the ``batch-bindings`` cross-check (which the native issuer does not run)."""
    from kvoffload.bindings.types import CopyMethod

    return issuer == "native" or (
        issuer == "auto" and cuda.copier.method is not CopyMethod.BATCH_BINDINGS)


def _handler_over(backend: Backend, undo: contextlib.ExitStack, plan: CopyPlan, num_src: int,
                  num_dst: int, book: JobBook | None) -> DirectionHandler:
    """A handler of ``plan``'s direction over ``backend``, which it owns from here on: its
    shutdown (``undo``'s on a rollback) releases the backend, once, or keeps it where a copy may
    still use it. Where the handler cannot be made the backend is released here."""
    try:
        handler = DirectionHandler.create(direction=plan.direction, plan=plan, backend=backend,
                                          num_src_blocks=num_src, num_dst_blocks=num_dst, book=book)
    except BaseException:
        backend.release()
        raise
    undo.callback(handler.shutdown, CREATE_ROLLBACK_TIMEOUT_S)
    return handler


def _made_backend(factory: Callable[[Direction], Backend], direction: Direction) -> Backend:
    """``factory(direction)``, checked to look like a :class:`Backend` before anything uses it.

    Raises:
        ArgumentTypeError: the factory returned something without the backend's methods.
    """
    backend = factory(direction)
    missing = [name for name in ("fence", "release_fence", "issue", "issue_cost", "release")
               if not callable(getattr(backend, name, None))]
    if missing:
        raise ArgumentTypeError(
            f"backend_factory({direction.value!r}) returned {backend!r:.80}, which has no "
            f"{', '.join(missing)}: it must return a Backend (kvoffload.handler.Backend)"
        )
    return backend


def _check_path(
    path: str, backend: str, staging_bytes: int, staging_slots: int, kernel_ctas: int | None
) -> None:
    _check_path_name("path", path, backend)
    for name, value, least in (("staging_bytes", staging_bytes, 1), ("staging_slots", staging_slots, 2)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(f"{name} = {value!r} must be an int")
        if value < least:
            raise InvalidArgumentError(f"{name} = {value} must be at least {least}")
    if kernel_ctas is not None:
        if isinstance(kernel_ctas, bool) or not isinstance(kernel_ctas, int):
            raise ArgumentTypeError(f"kernel_ctas = {kernel_ctas!r} must be an int or None")
        if kernel_ctas <= 0:
            raise InvalidArgumentError(f"kernel_ctas = {kernel_ctas} must be positive")


def _check_path_name(what: str, path: object, backend: str, *, none_too: bool = False) -> None:
    """``path`` (the argument ``what``) names a transfer path the backend has."""
    or_none = " or None" if none_too else ""
    if not isinstance(path, str):
        raise ArgumentTypeError(f"{what} = {path!r} must be a str{or_none}, not a {type(path).__name__}")
    if path not in _PATHS:
        raise InvalidArgumentError(f"{what} = {path!r} must be one of {', '.join(_PATHS)}{or_none}")
    if backend != "cuda" and path != "auto":
        raise InvalidArgumentError(f"{what} = {path!r} applies to the cuda backend only (backend is {backend!r})")


def _check_expedited_path(path: object, expedited_loads: bool, backend: str, factory: bool) -> None:
    if path is None:
        return
    if not expedited_loads:
        raise InvalidArgumentError(
            f"expedited_path = {path!r} names the expedited lane's path: create the worker with "
            "expedited_loads=True"
        )
    _check_path_name("expedited_path", path, backend, none_too=True)
    if factory:
        raise InvalidArgumentError(
            f"expedited_path = {path!r} names a path of the library's cuda backend; the "
            "backend_factory's backends move the lane's loads"
        )


def _drop_failed_frames(exc_type: object, exc: object, tb: TracebackType | None) -> bool:
    """On a failed ``create``, clear the locals of the finished frames the exception passes through
    (a part that failed while building held the region's record view there), so that the region's
    cleanup finds no view of ours left and unmaps at once, without a warning about the caller's
    views. The traceback keeps its lines; the exception goes on."""
    if tb is not None:
        traceback.clear_frames(tb)
    return False


def _shared_rank(shared: object, shared_name: str | None) -> PoolRank | None:
    """The pool rank to attach: ``shared``, or ``shared_name`` as the only rank of a pool."""
    if shared is not None and not isinstance(shared, PoolRank):
        raise ArgumentTypeError(
            f"shared must be a PoolRank (SharedPool(...).rank(r)) or None, got {type(shared).__name__}"
        )
    if shared_name is None:
        return shared
    if shared is not None:
        raise InvalidArgumentError("pass shared or shared_name, not both (shared_name is a one-rank pool)")
    return SharedPool(check_pool_name(shared_name, "shared_name"), 1).rank(0)


def _bounce_slots(bounce_slots: int | None, record_bytes: int) -> int:
    if bounce_slots is None:
        default = max(MIN_BOUNCE_SLOTS, min(MAX_BOUNCE_SLOTS, DEFAULT_BOUNCE_BYTES // record_bytes))
        return default - default % 2
    if isinstance(bounce_slots, bool) or not isinstance(bounce_slots, int):
        raise ArgumentTypeError(
            f"bounce_slots = {bounce_slots!r} must be an int >= 2, not a {type(bounce_slots).__name__}"
        )
    if bounce_slots < 2:
        raise InvalidArgumentError(f"bounce_slots = {bounce_slots!r} must be an int >= 2")
    return bounce_slots


def _index(device: torch.device) -> int:
    index: int | None = device.index
    return index if index is not None else torch.cuda.current_device()


def _host_sync(timeout_s: float) -> bool:
    """The host backend has no device: once its threads stopped, nothing touches the region."""
    return True


# ---------------------------------------------------------------------------------------- cuda


@attrs.frozen
class _Cuda:
    """The device-wide parts of a CUDA worker (each stateless or process-wide: nothing to release)."""

    index: int
    capabilities: Capabilities
    copier: Copier
    pinner: HostPinner
    device_sync: Callable[[float], bool]


def _cuda_parts(layout: DeviceLayout, copy_method: object) -> _Cuda:
    """The driver's capabilities, the copier, the pinner and the device-wide sync (the only place
    the assembly touches the driver layer, so a host-only worker never imports cuda-python)."""
    try:
        from kvoffload.bindings import driver
        from kvoffload.bindings.copier import Copier
    except ImportError as exc:
        raise MissingDependencyError(
            f"the cuda backend needs cuda-python ({exc}); install it with pip install "
            "'kvoffload[cuda]' (or pass CPU tensors for the host backend)"
        ) from exc

    method = _copy_method(copy_method, driver.CopyMethod)
    index = _index(layout.device)
    caps = driver.capabilities(index)
    return _Cuda(index=index, capabilities=caps, copier=Copier.create(caps, method),
                 pinner=driver.CudaHostPinner(index),
                 device_sync=functools.partial(driver.synchronize_device, index))


def _copy_method(method: object, kinds: type[enum.Enum]) -> Any:
    if method is None or isinstance(method, kinds):
        return method
    try:
        return kinds(method)
    except ValueError:
        names = ", ".join(str(m.value) for m in kinds)
        raise InvalidArgumentError(f"copy_method = {method!r} must be one of {names}") from None


def _check_copy_method_backend(copy_method: object, backend: str) -> None:
    if copy_method is not None and backend != "cuda":
        raise InvalidArgumentError(
            f"copy_method = {copy_method!r} applies to the cuda backend only (backend is {backend!r})"
        )


#: The expedited load lane's staging ring against a regular lane's, where the lane's path has one
#: (its loads are the few a step waits for, not bulk prefetches): a quarter, as long as a slot
#: still holds a record.
EXPEDITED_RING_SHARE: Final = 4
#: The expedited lane's loads up to this many bytes go through ``sm`` by default (the largest job
#: calibration times ``sm`` with: ``calibration.SM_MAX_JOB_BYTES``). Larger ones through ``sm``
#: were measured at 0.46-0.67x a pinned copy on an H100 whose ``staged`` lane ran at 0.84-1.02x
#: (docs/design.md §4).
EXPEDITED_SM_MAX_BYTES: Final = calibration.SM_MAX_JOB_BYTES


def _expedited_options(options: WorkerOptions, layout: DeviceLayout, mapped: bool) -> WorkerOptions:
    """The options of the expedited load lane's backend (docs/design.md §4, *A lane no copy
    engine holds*). With ``expedited_path``, that path for every load (``kernel_ctas`` where it is
    the worker's path). Without: the worker's path, except that loads of at most
    :data:`EXPEDITED_SM_MAX_BYTES` go through ``sm`` where the device addresses the pool as is
    (``mapped``: the copy kernel reads it; no copy engine, whose queue the regular lanes' copies
    hold). A staging ring of 1/EXPEDITED_RING_SHARE of a regular lane's where its slots still hold
    a record (a path without a ring makes none).
    """
    if options.expedited_path is None:
        lane = attrs.evolve(options, lane_sm_bytes=EXPEDITED_SM_MAX_BYTES if mapped else 0, regular=options)
    else:
        ctas = options.kernel_ctas if options.expedited_path == options.path else None
        lane = attrs.evolve(options, path=options.expedited_path, kernel_ctas=ctas, regular=options)
    smaller = attrs.evolve(lane, staging_bytes=options.staging_bytes // EXPEDITED_RING_SHARE)
    return smaller if _slot_bytes(smaller) >= layout.record_bytes else lane


def _mapped(cuda: _Cuda | None, region: RegionOwner) -> bool:
    """Whether the device addresses the pool's host pointers as is (UVA), so a kernel reads it."""
    if cuda is None:
        return False
    from kvoffload.bindings import driver

    return driver.host_pointer_is_device_pointer(cuda.index, region.base_ptr)


def _slot_bytes(options: WorkerOptions) -> int:
    """Bytes of one staging slot: the staged path's share of the rings, whole OS pages."""
    per_direction = options.staging_bytes // 2
    return per_direction // options.staging_slots // RECORD_ALIGN_BYTES * RECORD_ALIGN_BYTES


def _path_factory(
    direction: Direction, cuda: _Cuda, options: WorkerOptions, names: tuple[str, ...]
) -> Callable[[CudaStreams], Mapping[str, TransferPath]]:
    """``streams -> {name: path}`` for the named transfer paths of one direction."""

    def make(streams: CudaStreams) -> Mapping[str, TransferPath]:
        from kvoffload.backends import kernel as kpaths
        from kvoffload.backends.cuda import DmaPath
        from kvoffload.bindings import driver
        from kvoffload.bindings.kernel import CopyKernel

        copier = cuda.copier
        paths: dict[str, TransferPath] = {}
        if "dma" in names:
            paths["dma"] = DmaPath(direction, copier)
        if "sm" in names or "staged" in names:
            kernel = CopyKernel.for_device(cuda.index)
            tables = kpaths.SegmentTables(streams)
            if "sm" in names:
                ctas = options.kernel_ctas if options.path == "sm" and options.kernel_ctas else kpaths.SM_CTAS
                paths["sm"] = kpaths.SmPath(direction, kernel, tables, ctas)
            if "staged" in names:
                ctas = options.kernel_ctas or kpaths.STAGED_CTAS or driver.multiprocessor_count(cuda.index)
                paths["staged"] = kpaths.StagedPath(direction, streams, kernel, copier, tables, ctas,
                                                    options.staging_slots, _slot_bytes(options))
        return paths

    return make


def _cuda_backend(
    direction: Direction, layout: DeviceLayout, region: RegionOwner, cuda: _Cuda, options: WorkerOptions,
    issuer: str,
) -> CudaBackend:
    """The backend of one direction for the chosen transfer path (see ``Worker.create``).

    ``issuer``: the worker's (``Worker.create``'s argument); ``auto``'s calibration times each path
    through the issuer the worker's jobs will take (:func:`_calibration_issuer`), since the two
    issuers' host costs rank the paths differently for small jobs (docs/design.md §16)."""
    from kvoffload.backends.cuda import CudaBackend
    from kvoffload.bindings import driver

    path = options.path
    fits = _slot_bytes(options) >= layout.record_bytes
    if path == "staged" and not fits:
        raise InvalidArgumentError(
            f"path 'staged': a host record of {layout.record_bytes} bytes does not fit a staging slot "
            f"of {_slot_bytes(options)} bytes (staging_bytes = {options.staging_bytes} over 2 "
            f"directions x {options.staging_slots} slots); raise staging_bytes or use path 'dma'"
        )
    mapped = path in ("sm", "auto") and driver.host_pointer_is_device_pointer(cuda.index, region.base_ptr)
    if path == "sm" and not mapped:
        raise InvalidArgumentError("path 'sm' needs host memory the device addresses as is (UVA)")
    device = layout.device
    names: tuple[str, ...]
    choose: Callable[[int], str] | None
    shown: str | None
    measured: dict[str, tuple[float, ...]] | None = None  # auto's layered figures (calibration.LAYERED)
    if path in ("dma", "sm", "staged") or not fits:
        name = path if path != "auto" else "dma"
        # what results name: the path object's name (a dma path's is its copier's: "dma-loop")
        names, choose, shown = (name,), None, cuda.copier.path if name == "dma" else name
    else:
        names = tuple(p for p in calibration.CANDIDATES if p != "sm" or mapped)

        def calibrated(timed_by: Literal["native", "python"]) -> calibration.AutoChoice:
            return calibration.calibrate(
                device, layout.page_table,
                key=calibration.geometry_key(cuda.capabilities.device_name, layout.page_table, names,
                                             issuer=timed_by, layers=layout.layer_tables),
                candidates=names, layers=layout.layer_tables,
                scratch_pool=functools.partial(_scratch_pool, cuda),
                handler_for=functools.partial(_path_handler, cuda, options.regular or options, device,
                                              timed_by, strict=issuer == "native"),
                persist_path=options.calibration_path,
            )

        timed_by = _calibration_issuer(cuda, issuer)
        try:
            choice = calibrated(timed_by)
        except _NativeDidNotStart as exc:
            # issuer "auto": the worker's jobs will be issued from Python (_issuing warns for them)
            _log.warning("the native issuer did not start for auto's calibration (%s): its paths "
                         "are timed from Python", exc.__cause__)
            choice = calibrated("python")
        choose, shown, measured = choice.chooser(direction), "auto", choice.layered()
    small = options.lane_sm_bytes // layout.record_bytes  # set only where the pool is mapped
    if small > 0 and names != ("sm",):  # the expedited lane: its small loads through sm
        choose = _small_through_sm(small, choose or functools.partial(_only, names[0]))
        names = (*names, "sm") if "sm" not in names else names  # results name each job's path
    # auto's layered loads: sm where the size's path would move narrow spans as descriptors slower
    layered = (calibration.LayeredChoice(choose, layout.layer_tables, measured).path
               if shown == "auto" and choose is not None and "sm" in names and direction is Direction.LOAD
               and layout.layer_tables else None)
    return CudaBackend.create(direction, device, _path_factory(direction, cuda, options, names),
                              choose=choose, kernel_stream=names != ("dma",), path_name=shown,
                              layered=layered)


def _only(name: str, _blocks: int) -> str:
    """A fixed path's chooser (with ``functools.partial``)."""
    return name


def _small_through_sm(blocks: int, bulk: Callable[[int], str]) -> Callable[[int], str]:
    """A chooser: ``sm`` for jobs of at most ``blocks`` blocks, ``bulk``'s path for larger ones."""
    return lambda n: "sm" if n <= blocks else bulk(n)


@contextlib.contextmanager
def _scratch_pool(cuda: _Cuda, num_records: int, record_bytes: int) -> Iterator[RegionOwner]:
    """A pinned scratch pool for calibration, released when the block exits."""
    region = RegionOwner.create(num_records=num_records, record_bytes=record_bytes, pinner=cuda.pinner)
    try:
        yield region
    finally:
        region.cleanup()


def _calibration_issuer(cuda: _Cuda, issuer: str) -> Literal["native", "python"]:
    """The issuer ``auto``'s calibration times the paths through first: the one the worker's jobs
    take (``issuer`` "native"; "auto" where the native library loads and the copy method allows
    it, as :func:`_issuing` decides), else "python". Under "auto", a native issuer that loads and
    then does not start is found by the first calibration handler, and the calibration is made
    again from Python (:func:`_cuda_backend`), as the worker's jobs will then be issued."""
    if not _tries_native(cuda, issuer):
        return "python"
    if issuer == "auto":
        from kvoffload import native

        try:
            native.library()
        except KVOffloadError:
            return "python"  # _issuing warns once, for the worker's backend
    return "native"


class _NativeDidNotStart(Exception):
    """A calibration handler's native issuer did not start (the error is its ``__cause__``)."""


@contextlib.contextmanager
def _path_handler(
    cuda: _Cuda, options: WorkerOptions, device: torch.device, issuer: Literal["native", "python"],
    path: str, plan: CopyPlan, blocks: int, *, strict: bool = False,
) -> Iterator[DirectionHandler]:
    """A handler of one ``path`` over ``plan`` for calibration, its jobs issued through ``issuer``
    ("native" or "python"), shut down (its backend released) when the block exits.

    Raises:
        _NativeDidNotStart: the native issuer did not start and ``strict`` is False (the worker's
            issuer is "auto": its caller times the paths from Python instead, as the worker's
            jobs will be issued); with ``strict`` the error itself, as ``Worker.create`` raises it.
    """
    from kvoffload.backends.cuda import CudaBackend

    inner = CudaBackend.create(plan.direction, device, _path_factory(plan.direction, cuda, options, (path,)),
                               kernel_stream=path != "dma")
    try:
        backend = _issuing(inner, cuda, issuer)  # "native" releases inner when it fails
    except KVOffloadError as exc:
        if strict:
            raise
        raise _NativeDidNotStart(str(exc)) from exc
    try:
        handler = DirectionHandler.create(direction=plan.direction, plan=plan, backend=backend,
                                          num_src_blocks=blocks, num_dst_blocks=blocks)
    except BaseException:
        backend.release()
        raise
    try:
        yield handler
    finally:
        handler.shutdown(_CALIBRATION_STOP_S)


# ---------------------------------------------------------------------------------------- disk


def _bounce_handlers(
    layout: DeviceLayout, region: RegionOwner, cuda: _Cuda | None,
    backend_factory: BackendFactory | None, undo: contextlib.ExitStack,
) -> tuple[DirectionHandler, DirectionHandler]:
    """The handlers that copy device blocks to and from bounce rows (batched DMA or host copies);
    their ids and results are internal to the disk pipeline (books of their own)."""
    made = []
    for direction, num_src, num_dst in (
        (Direction.STORE, layout.num_blocks, region.num_records),
        (Direction.LOAD, region.num_records, layout.num_blocks),
    ):
        plan = CopyPlan(layout.page_table, region.base_ptr, region.chunk_records, direction,
                        host_stride=region.record_stride)
        backend: Backend
        if backend_factory is not None:
            backend = backend_factory(direction)
        elif cuda is not None:
            from kvoffload.backends.cuda import CudaBackend

            backend = CudaBackend.create(direction, layout.device,
                                         _path_factory(direction, cuda, WorkerOptions(), ("dma",)))
        else:
            backend = HostBackend(direction)
        made.append(_handler_over(backend, undo, plan, num_src, num_dst, None))
    return made[0], made[1]
