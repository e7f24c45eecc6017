"""Driver bindings: the only module that imports cuda-python.

Owns the CUDA facts the rest of the library relies on: which driver calls exist, how their results
are checked, which source access order each direction uses, and how a job's copy descriptors reach
the driver. Every ``CUresult`` is checked at the call and turned into a :class:`CudaError` naming
the call, the error name and the driver's message; ``CUDA_ERROR_NOT_READY`` from a query is a
normal answer.

Three ways to issue a set of copies, chosen per worker (see :class:`CopyMethod`):

* ``BATCH_CTYPES``: ``cuMemcpyBatchAsync`` resolved with ``cuGetProcAddress`` for the ABI version
  it is called with (CUDA 13 removed the ``failIdx`` argument) and called through ctypes with numpy
  ``uint64`` arrays, so no per-page Python object is built. The default where available.
* ``BATCH_BINDINGS``: the same driver call through cuda-python's wrapper (one ``CUdeviceptr``
  object per pointer; slower, kept as a cross-check).
* ``PER_COPY``: one ``cuMemcpyAsync`` per copy; the fallback when the driver has no batch memcpy.

The legacy default stream (handle 0) is refused for every copy: batch memcpy rejects it, and a copy
on it would serialise with every other stream.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from typing_extensions import TypeVarTuple, Unpack

import attrs
import numpy as np
import numpy.typing as npt
from cuda.bindings import driver as _drv

from kvoffload.errors import CudaError, InvalidArgumentError, KVOffloadError

__all__ = [
    "BATCH_MAX_COPIES",
    "HOST_REGISTER_DEVICEMAP",
    "HOST_REGISTER_PORTABLE",
    "PIN_CHUNK_BYTES",
    "Capabilities",
    "CopyMethod",
    "Copier",
    "CudaHostPinner",
    "HostPinner",
    "NoPinner",
    "SrcAccessOrder",
    "capabilities",
    "check",
    "create_stream",
    "destroy_stream",
    "ensure_context_current",
    "Event",
    "EventPool",
    "KernelLauncher",
    "event_pool",
    "elapsed_seconds",
    "memcpy_async",
    "resolve_driver_function",
    "make_context_current",
    "pin_chunks",
    "synchronize_device",
    "unpin_chunks",
]

U64Array = npt.NDArray[np.uint64]
_Ts = TypeVarTuple("_Ts")

#: cuMemHostRegister flags (plain ints in cuda-python).
HOST_REGISTER_PORTABLE: Final = 1
HOST_REGISTER_DEVICEMAP: Final = 2
#: Largest single host registration; one registration of >= 512 GiB fails on r580 drivers.
PIN_CHUNK_BYTES: Final = 64 << 30
#: Copies per driver call; a longer job is issued as several batches on the same stream.
BATCH_MAX_COPIES: Final = 1 << 16
#: Driver versions (1000 * major + 10 * minor) of the two batch memcpy C ABIs.
BATCH_ABI_CUDA_12_8: Final = 12080
BATCH_ABI_CUDA_13_0: Final = 13000
_LEGACY_DEFAULT_STREAM: Final = 0
_DEVICE_NAME_BYTES: Final = 256


class SrcAccessOrder(enum.IntEnum):
    """``CUmemcpySrcAccessOrder``: when the driver may read a copy's source.

    ``STREAM`` reads in stream order, after every earlier wait on the stream: mandatory for stores,
    whose source is device memory that compute may still be writing. ``ANY`` lets the driver read the
    source at any time after the call; it is allowed for loads only because their source is pinned
    host memory that no stream writes while the load is in flight (docs/design.md §5 rule 3).
    """

    STREAM = 1
    DURING_API_CALL = 2
    ANY = 3


class CopyMethod(enum.Enum):
    """How a set of copy descriptors is handed to the driver (see the module docstring)."""

    BATCH_CTYPES = "batch-ctypes"
    BATCH_BINDINGS = "batch-bindings"
    PER_COPY = "per-copy"


def _error_text(code: _drv.CUresult) -> tuple[str, str]:
    """The driver's name and description of an error (the enum's name when the driver is gone)."""
    try:
        name_res = _drv.cuGetErrorName(code)
        text_res = _drv.cuGetErrorString(code)
    except RuntimeError:  # no driver library to ask
        return code.name, "no description: the CUDA driver library is not available"
    name = _decode(name_res[1]) if int(name_res[0]) == 0 else code.name
    text = _decode(text_res[1]) if int(text_res[0]) == 0 else "no description from the driver"
    return name, text


def _decode(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _raise_for(call: str, code: _drv.CUresult) -> None:
    name, text = _error_text(code)
    raise CudaError(call, int(code), name, text)


def check(call: str, result: tuple[_drv.CUresult, Unpack[_Ts]]) -> tuple[Unpack[_Ts]]:
    """Check a cuda-python result tuple; return the values after the ``CUresult``.

    Reads ``result[0]`` only and never unpacks a fixed length (the tuple's length differs across
    cuda-python versions on errors).

    Raises:
        CudaError: the call returned anything but ``CUDA_SUCCESS``.
    """
    code = result[0]
    if code != _drv.CUresult.CUDA_SUCCESS:
        _raise_for(call, code)
    return result[1:]


def _checked_code(call: str, code: int) -> None:
    """Check a raw ``CUresult`` integer returned through ctypes."""
    if code != 0:
        _raise_for(call, _drv.CUresult(code))


def _call_driver(
    call: str, fn: Callable[[], tuple[_drv.CUresult, Unpack[_Ts]]]
) -> tuple[Unpack[_Ts]]:
    """Run a driver call, turning a missing driver library into a :class:`CudaError`."""
    try:
        result = fn()
    except RuntimeError as exc:  # libcuda absent, or the symbol missing from this driver
        raise CudaError(call, -1, "DRIVER_UNAVAILABLE", str(exc)) from exc
    return check(call, result)


# ---------------------------------------------------------------------------------------------
# Capabilities


@attrs.frozen
class Capabilities:
    """What this process can do on one device, detected once at start.

    Attributes:
        device_index: CUDA ordinal.
        device_name: the driver's name for it.
        driver_version: ``cuDriverGetVersion`` (1000 * major + 10 * minor).
        batch_memcpy: ``cuMemcpyBatchAsync`` is usable (driver >= 12.8 and the symbol resolves).
        batch_abi_version: the ABI version the ctypes path resolved the symbol with, or None.
        copy_method: the method a worker uses by default.
        notes: human-readable reasons for any fallback.
    """

    device_index: int
    device_name: str
    driver_version: int
    batch_memcpy: bool
    batch_abi_version: int | None
    copy_method: CopyMethod
    notes: tuple[str, ...] = ()


_init_lock = threading.RLock()  # re-entrant: an event returned by the collector may need it
_primary_contexts: dict[int, _drv.CUcontext] = {}


def make_context_current(device_index: int) -> None:
    """Make the device's primary context current in the calling thread.

    A new Python thread has no current context, and batch memcpy then fails with a misleading
    ``CUDA_ERROR_INVALID_VALUE``; every thread that issues driver calls calls this first. The
    primary context is retained once per process and never released (torch holds it as well).
    """
    with _init_lock:
        ctx = _primary_contexts.get(device_index)
        if ctx is None:
            _call_driver("cuInit", lambda: _drv.cuInit(0))
            dev = _device_handle(device_index)
            (retained,) = _call_driver(
                "cuDevicePrimaryCtxRetain", lambda: _drv.cuDevicePrimaryCtxRetain(dev)
            )
            ctx = retained
            _primary_contexts[device_index] = ctx
    _call_driver("cuCtxSetCurrent", lambda: _drv.cuCtxSetCurrent(ctx))


def ensure_context_current(device_index: int) -> None:
    """Make the device's primary context current in the calling thread unless it already is (one
    ``cuCtxGetCurrent`` through ctypes when it is). Batched copies and launches need it; a stream
    handle alone does not carry it to the driver.

    Raises:
        CudaError: the driver refused.
    """
    current = ctypes.c_void_p(0)
    code = _hot().ctx_get_current(ctypes.byref(current))
    ctx = _primary_contexts.get(device_index)
    if code != 0 or ctx is None or (current.value or 0) != int(ctx):
        make_context_current(device_index)


def _device_handle(device_index: int) -> _drv.CUdevice:
    (dev,) = _call_driver("cuDeviceGet", lambda: _drv.cuDeviceGet(device_index))
    return dev


@functools.cache
def capabilities(device_index: int) -> Capabilities:
    """Detect driver version, device name and batch memcpy support for one device (cached).

    Raises:
        CudaError: no usable driver or device.
    """
    make_context_current(device_index)
    (version,) = _call_driver("cuDriverGetVersion", _drv.cuDriverGetVersion)
    dev = _device_handle(device_index)
    (raw_name,) = _call_driver(
        "cuDeviceGetName", lambda: _drv.cuDeviceGetName(_DEVICE_NAME_BYTES, dev)
    )
    name = _decode(raw_name).split("\x00", 1)[0]
    notes: list[str] = []
    abi = _batch_abi_for(version)
    pointer = _resolve_batch_symbol(abi) if abi is not None else None
    if abi is None:
        notes.append(f"driver {version} predates cuMemcpyBatchAsync (needs 12080): per-copy loop")
    elif pointer is None:
        notes.append(f"cuMemcpyBatchAsync did not resolve for ABI {abi}: per-copy loop")
    batch = pointer is not None
    return Capabilities(
        device_index=device_index,
        device_name=name,
        driver_version=version,
        batch_memcpy=batch,
        batch_abi_version=abi if batch else None,
        copy_method=CopyMethod.BATCH_CTYPES if batch else CopyMethod.PER_COPY,
        notes=tuple(notes),
    )


def _batch_abi_for(driver_version: int) -> int | None:
    if driver_version >= BATCH_ABI_CUDA_13_0:
        return BATCH_ABI_CUDA_13_0
    if driver_version >= BATCH_ABI_CUDA_12_8:
        return BATCH_ABI_CUDA_12_8
    return None


@functools.cache
def _resolve_batch_symbol(abi_version: int) -> int | None:
    """Address of ``cuMemcpyBatchAsync`` for one ABI version, or None when the driver lacks it."""
    try:
        result = _drv.cuGetProcAddress(b"cuMemcpyBatchAsync", abi_version, 0)
    except RuntimeError:
        return None
    if int(result[0]) != 0:
        return None
    pfn = result[1]
    address = int(pfn) if pfn is not None else 0
    status = result[2] if len(result) > 2 else None
    if status is not None and int(status) != 0:
        return None
    return address or None


_BATCH_ARGTYPES_13: Final = (
    ctypes.c_void_p,  # CUdeviceptr* dsts
    ctypes.c_void_p,  # CUdeviceptr* srcs
    ctypes.c_void_p,  # size_t* sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes* attrs
    ctypes.c_void_p,  # size_t* attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # CUstream
)
_BATCH_ARGTYPES_12_8: Final = _BATCH_ARGTYPES_13[:7] + (ctypes.c_void_p, ctypes.c_void_p)


# ---------------------------------------------------------------------------------------------
# Copies


class Copier:
    """Issues copy descriptors on a stream with one :class:`CopyMethod`.

    Owns: nothing the driver must release (the attribute structs and index arrays are host memory
    kept alive for the copier's lifetime). Borrows: the stream handles it is given per call.
    Thread-safe: it holds no per-call state.
    """

    def __init__(
        self, method: CopyMethod, abi_version: int | None, symbol: int | None, device_index: int = 0
    ) -> None:
        self.method = method
        self.device_index = device_index
        self._abi_version = abi_version
        self._attrs = {order: _make_attrs(order) for order in SrcAccessOrder}
        self._attrs_ptr = {order: attrs_struct.getPtr() for order, attrs_struct in self._attrs.items()}
        self._attrs_idx = np.zeros(1, dtype=np.uint64)
        self._attrs_idx_ptr = self._attrs_idx.ctypes.data
        self._fn: Callable[..., int] | None = None
        if method is CopyMethod.BATCH_CTYPES:
            if symbol is None or abi_version is None:
                raise InvalidArgumentError("copy method batch-ctypes needs cuMemcpyBatchAsync")
            argtypes = _BATCH_ARGTYPES_13 if abi_version >= BATCH_ABI_CUDA_13_0 else _BATCH_ARGTYPES_12_8
            prototype = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)
            self._fn = prototype(symbol)

    @classmethod
    def create(cls, caps: Capabilities, method: CopyMethod | None = None) -> Copier:
        """A copier for the device described by ``caps``; ``method`` None picks the default.

        Raises:
            InvalidArgumentError: a batch method was asked for on a driver without batch memcpy.
        """
        chosen = method if method is not None else caps.copy_method
        if chosen is not CopyMethod.PER_COPY and not caps.batch_memcpy:
            raise InvalidArgumentError(
                f"copy method {chosen.value!r} needs cuMemcpyBatchAsync, which driver "
                f"{caps.driver_version} on {caps.device_name} does not provide"
            )
        symbol = _resolve_batch_symbol(caps.batch_abi_version) if caps.batch_abi_version else None
        return cls(chosen, caps.batch_abi_version, symbol, caps.device_index)

    @property
    def path(self) -> str:
        """The transfer-path name reported in results: ``dma`` for batches, ``dma-loop`` otherwise."""
        return "dma-loop" if self.method is CopyMethod.PER_COPY else "dma"

    def copy(
        self,
        dsts: U64Array,
        srcs: U64Array,
        sizes: U64Array,
        order: SrcAccessOrder,
        stream: int,
    ) -> None:
        """Enqueue ``len(dsts)`` copies on ``stream`` with the given source access order.

        The arrays must be C-contiguous ``uint64`` of equal length; the copies run in stream order
        relative to earlier work on ``stream`` (for ``ANY``, their source may be read earlier).

        A single copy goes through ``cuMemcpyAsync`` (stream-ordered, which satisfies either order):
        the batch call costs the host several times more for one descriptor.

        Raises:
            InvalidArgumentError: the legacy default stream, or malformed arrays.
            CudaError: the driver refused the copies. Copies of earlier batches of the same call
                may already be enqueued; the caller must still wait for the stream before reusing
                the buffers.
        """
        if stream == _LEGACY_DEFAULT_STREAM:
            raise InvalidArgumentError("copies are never issued on the legacy default stream (0)")
        count = len(dsts)
        if not (len(srcs) == count == len(sizes)):
            raise InvalidArgumentError(
                f"descriptor arrays differ in length: dsts {count}, srcs {len(srcs)}, sizes {len(sizes)}"
            )
        if count == 1 and self.method is CopyMethod.BATCH_CTYPES:
            memcpy_async(int(dsts[0]), int(srcs[0]), int(sizes[0]), stream, self.device_index)
            return
        for start in range(0, count, BATCH_MAX_COPIES):
            stop = min(count, start + BATCH_MAX_COPIES)
            if self.method is CopyMethod.BATCH_CTYPES:
                self._copy_ctypes(dsts[start:stop], srcs[start:stop], sizes[start:stop], order, stream)
            elif self.method is CopyMethod.BATCH_BINDINGS:
                self._copy_bindings(dsts[start:stop], srcs[start:stop], sizes[start:stop], order, stream)
            else:
                self._copy_loop(dsts[start:stop], srcs[start:stop], sizes[start:stop], stream)

    def _copy_ctypes(
        self, dsts: U64Array, srcs: U64Array, sizes: U64Array, order: SrcAccessOrder, stream: int
    ) -> None:
        assert self._fn is not None and self._abi_version is not None
        d = np.ascontiguousarray(dsts, dtype=np.uint64)
        s = np.ascontiguousarray(srcs, dtype=np.uint64)
        n = np.ascontiguousarray(sizes, dtype=np.uint64)
        attrs_ptr = self._attrs_ptr[order]
        if self._abi_version >= BATCH_ABI_CUDA_13_0:
            code = self._fn(
                d.ctypes.data, s.ctypes.data, n.ctypes.data, len(d),
                attrs_ptr, self._attrs_idx_ptr, 1, stream,
            )
        else:
            fail_idx = ctypes.c_size_t(0)
            code = self._fn(
                d.ctypes.data, s.ctypes.data, n.ctypes.data, len(d),
                attrs_ptr, self._attrs_idx_ptr, 1, ctypes.addressof(fail_idx), stream,
            )
        _checked_code("cuMemcpyBatchAsync", code)

    def _copy_bindings(
        self, dsts: U64Array, srcs: U64Array, sizes: U64Array, order: SrcAccessOrder, stream: int
    ) -> None:
        d = [_drv.CUdeviceptr(int(x)) for x in dsts]
        s = [_drv.CUdeviceptr(int(x)) for x in srcs]
        n = [int(x) for x in sizes]
        _call_driver(
            "cuMemcpyBatchAsync",
            lambda: _drv.cuMemcpyBatchAsync(
                d, s, n, len(d), [self._attrs[order]], [0], 1, _drv.CUstream(stream)
            ),
        )

    def _copy_loop(self, dsts: U64Array, srcs: U64Array, sizes: U64Array, stream: int) -> None:
        handle = _drv.CUstream(stream)
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            _call_driver(
                "cuMemcpyAsync",
                lambda: _drv.cuMemcpyAsync(
                    _drv.CUdeviceptr(dst), _drv.CUdeviceptr(src), size, handle
                ),
            )


def _make_attrs(order: SrcAccessOrder) -> _drv.CUmemcpyAttributes:
    attrs_struct = _drv.CUmemcpyAttributes()
    attrs_struct.srcAccessOrder = _drv.CUmemcpySrcAccessOrder(int(order))
    return attrs_struct


#: ``CU_STREAM_NON_BLOCKING``: the stream never synchronises with the legacy default stream.
STREAM_NON_BLOCKING: Final = 1


def create_stream(device_index: int, priority: int = 0) -> int:
    """Create a non-blocking stream on the device; returns its handle (never 0).

    The caller owns the stream and must release it with :func:`destroy_stream` exactly once. A
    stream of its own (rather than one from torch's shared pool) means no other component's work is
    ever queued on it.

    Raises:
        CudaError: the driver could not create it.
    """
    make_context_current(device_index)
    (stream,) = _call_driver(
        "cuStreamCreateWithPriority",
        lambda: _drv.cuStreamCreateWithPriority(STREAM_NON_BLOCKING, priority),
    )
    return int(stream)


def destroy_stream(device_index: int, handle: int) -> None:
    """Destroy a stream made by :func:`create_stream`. Work still queued on it completes first (the
    driver defers the release).

    Raises:
        CudaError: the driver refused (e.g. an invalid handle).
    """
    make_context_current(device_index)
    _call_driver("cuStreamDestroy", lambda: _drv.cuStreamDestroy(_drv.CUstream(handle)))


def synchronize_device(device_index: int, timeout_s: float) -> bool:
    """Wait for all work on the device, for at most ``timeout_s``.

    ``cuCtxSynchronize`` has no deadline, so it runs on a helper daemon thread that this call joins
    with the timeout; a synchronize that hangs leaves that thread blocked, never the caller.

    Returns:
        True when the device finished its work within the timeout, False when the time ran out.

    Raises:
        CudaError: the synchronize itself reported an error (the device cannot be proven idle).
    """
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            make_context_current(device_index)
            _call_driver("cuCtxSynchronize", _drv.cuCtxSynchronize)
            outcome.append(None)
        except BaseException as exc:  # reported to the caller below
            outcome.append(exc)

    thread = threading.Thread(target=run, name=f"kvoffload-sync-{device_index}", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    if thread.is_alive() or not outcome:
        return False
    error = outcome[0]
    if error is not None:
        raise error
    return True


# ---------------------------------------------------------------------------------------------
# Stream-ordered calls on the submission path

#: ABI version the submission-path calls are resolved for (their signatures are unchanged since it).
HOT_ABI_VERSION: Final = 12000
#: ``CU_EVENT_DISABLE_TIMING``.
EVENT_DISABLE_TIMING: Final = 2
#: Free events an :class:`EventPool` keeps; more are destroyed as they come back.
EVENT_POOL_MAX_FREE: Final = 1024
_INVALID_CONTEXT: Final = int(_drv.CUresult.CUDA_ERROR_INVALID_CONTEXT)
_NOT_READY: Final = int(_drv.CUresult.CUDA_ERROR_NOT_READY)


def resolve_driver_function(name: bytes, abi_version: int, *argtypes: Any) -> Callable[..., int]:
    """A driver entry point resolved with ``cuGetProcAddress`` for ``abi_version``, callable through
    ctypes (``CUresult`` as an int). The GIL is released during the call: any driver call may wait
    on a lock another thread's long call holds (a host registration, a module load), and the other
    Python threads must go on meanwhile.

    Raises:
        CudaError: the driver does not provide the symbol for that version.
    """
    try:
        result = _drv.cuGetProcAddress(name, abi_version, 0)
    except RuntimeError as exc:  # no driver library
        raise CudaError("cuGetProcAddress", -1, "DRIVER_UNAVAILABLE", str(exc)) from exc
    address = int(result[1]) if int(result[0]) == 0 and result[1] is not None else 0
    if not address:
        raise CudaError("cuGetProcAddress", int(result[0]), _decode(name), "symbol not found")
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(address)


class _HotCalls:
    """The driver calls a job's submission makes, called through ctypes: about a microsecond each,
    against several for cuda-python's wrappers or torch's event objects."""

    def __init__(self) -> None:
        p, u, f = ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_float)
        resolve = resolve_driver_function
        self.event_create = resolve(b"cuEventCreate", HOT_ABI_VERSION, ctypes.POINTER(p), u)
        self.event_destroy = resolve(b"cuEventDestroy", HOT_ABI_VERSION, p)
        self.event_record = resolve(b"cuEventRecord", HOT_ABI_VERSION, p, p)
        self.event_query = resolve(b"cuEventQuery", HOT_ABI_VERSION, p)
        self.event_elapsed = resolve(b"cuEventElapsedTime", HOT_ABI_VERSION, f, p, p)
        self.stream_wait_event = resolve(b"cuStreamWaitEvent", HOT_ABI_VERSION, p, p, u)
        self.ctx_get_current = resolve(b"cuCtxGetCurrent", HOT_ABI_VERSION, ctypes.POINTER(p))
        self.memcpy_async = resolve_driver_function(
            b"cuMemcpyAsync", HOT_ABI_VERSION, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, p
        )


@functools.cache
def _hot() -> _HotCalls:
    return _HotCalls()


def _hot_call(call: str, device_index: int, fn: Callable[..., int], *args: Any) -> int:
    """Run a ctypes driver call; on a thread with no current context, make the device's current and
    retry once. Returns the ``CUresult`` (``NOT_READY`` included); raises on any other error."""
    code = fn(*args)
    if code == _INVALID_CONTEXT:
        make_context_current(device_index)
        code = fn(*args)
    if code != 0 and code != _NOT_READY:
        _raise_for(call, _drv.CUresult(code))
    return code


def elapsed_seconds(start: int, end: int, device_index: int) -> float:
    """Device time between two completed timing events (``cuEventElapsedTime``), in seconds.

    Raises:
        CudaError: an event is not complete or was made without timing.
    """
    ms = ctypes.c_float(0.0)
    _hot_call("cuEventElapsedTime", device_index, _hot().event_elapsed, ctypes.byref(ms), start, end)
    return float(ms.value) / 1e3


def memcpy_async(dst: int, src: int, nbytes: int, stream: int, device_index: int) -> None:
    """One stream-ordered copy (``cuMemcpyAsync``): its source is read after every earlier wait on
    ``stream``, as with :attr:`SrcAccessOrder.STREAM`.

    Raises:
        InvalidArgumentError: the legacy default stream.
        CudaError: the driver refused.
    """
    if stream == _LEGACY_DEFAULT_STREAM:
        raise InvalidArgumentError("copies are never issued on the legacy default stream (0)")
    _hot_call("cuMemcpyAsync", device_index, _hot().memcpy_async, dst, src, nbytes, stream)


class EventPool:
    """Reusable CUDA events of one device and kind: recording a pooled event costs a driver call,
    against an event create, record and destroy for a fresh one.

    Owns: its free events (at most :data:`EVENT_POOL_MAX_FREE`; extra ones are destroyed as they come
    back). One pool per (device, kind) lives for the process, like the primary context: an event
    may still be referenced by work on any stream until the process ends. Thread-safe without a
    lock: ``list.pop`` and ``list.append`` are atomic under the GIL (two threads returning events at
    once may keep a few more than the bound).
    """

    def __init__(self, device_index: int, timing: bool) -> None:
        self.device_index = device_index
        self.timing = timing
        self._free: list[int] = []

    def take(self) -> int:
        """A free event (created when none is free).

        Raises:
            CudaError: the driver could not create one.
        """
        try:
            return self._free.pop()
        except IndexError:
            pass
        handle = ctypes.c_void_p(0)
        flags = 0 if self.timing else EVENT_DISABLE_TIMING
        _hot_call("cuEventCreate", self.device_index, _hot().event_create, ctypes.byref(handle), flags)
        return int(handle.value or 0)

    def give(self, event: int) -> None:
        """Return an event nothing will wait on or query any more (its last record may still be
        pending: a later record replaces it). Never raises."""
        if len(self._free) < EVENT_POOL_MAX_FREE:
            self._free.append(event)
            return
        try:
            _hot_call("cuEventDestroy", self.device_index, _hot().event_destroy, event)
        except Exception:  # a destroy that fails leaves the event to the process; nothing to undo
            pass

    @property
    def free(self) -> int:
        """Events ready to be taken."""
        return len(self._free)


@functools.cache
def event_pool(device_index: int, timing: bool) -> EventPool:
    """The process's :class:`EventPool` for one device and kind."""
    return EventPool(device_index, timing)


class Event:
    """One event taken from an :class:`EventPool`, returned to it when this object is dropped.

    Owns: its event, from construction until it is garbage (CPython drops it as the last reference
    goes: the ticket whose result was read, the fence whose last job was issued, the backend that
    was released). Nothing waits on a dropped event: stream waits capture the record they were
    enqueued after, and queries go through this object.
    """

    __slots__ = ("handle", "device_index", "_pool")

    def __init__(self, pool: EventPool) -> None:
        self.handle = pool.take()
        self.device_index = pool.device_index
        self._pool = pool

    def record(self, stream: int) -> None:
        """Record on ``stream`` (replacing the previous record). Raises :class:`CudaError`."""
        _hot_call("cuEventRecord", self.device_index, _hot().event_record, self.handle, stream)

    def wait_on(self, stream: int) -> None:
        """Make ``stream`` wait for this event's current record. Raises :class:`CudaError`."""
        _hot_call("cuStreamWaitEvent", self.device_index, _hot().stream_wait_event, stream,
                  self.handle, 0)

    def done(self) -> bool:
        """Whether the current record completed; never blocks. Raises :class:`CudaError`."""
        return _hot_call("cuEventQuery", self.device_index, _hot().event_query, self.handle) == 0

    def seconds_until(self, end: Event) -> float:
        """Device seconds from this event to ``end`` (both timing events, both complete)."""
        return elapsed_seconds(self.handle, end.handle, self.device_index)

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.give(self.handle)


# ---------------------------------------------------------------------------------------------
# Host registration


class HostPinner(Protocol):
    """Registers host memory with the device (page-locks it for DMA) and unregisters it.

    ``register`` either registers the whole range or raises with nothing registered; ``unregister``
    takes the start address of a range that ``register`` accepted.
    """

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``[ptr, ptr + nbytes)`` for DMA."""

    def unregister(self, ptr: int) -> None:
        """Release the registration that starts at ``ptr``."""


class CudaHostPinner:
    """Registers host ranges with ``cuMemHostRegister`` (portable, device-mapped) for one device.

    Owns nothing: the caller owns each registration it makes and must unregister it before it
    unmaps the memory (a re-mapped address can otherwise serve the old pages to later copies).
    """

    FLAGS: Final = HOST_REGISTER_PORTABLE | HOST_REGISTER_DEVICEMAP

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index

    def register(self, ptr: int, nbytes: int) -> None:
        """``cuMemHostRegister(ptr, nbytes, PORTABLE | DEVICEMAP)``; raises :class:`CudaError`."""
        make_context_current(self.device_index)
        _call_driver("cuMemHostRegister", lambda: _drv.cuMemHostRegister(ptr, nbytes, self.FLAGS))

    def unregister(self, ptr: int) -> None:
        """``cuMemHostUnregister(ptr)``; raises :class:`CudaError`."""
        make_context_current(self.device_index)
        _call_driver("cuMemHostUnregister", lambda: _drv.cuMemHostUnregister(ptr))


class NoPinner:
    """A pinner for the host backend: host memory needs no registration. Owns nothing."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Accept the range without doing anything."""

    def unregister(self, ptr: int) -> None:
        """Accept the release without doing anything."""


def pin_chunks(
    pinner: HostPinner, ptr: int, nbytes: int, chunk_bytes: int
) -> list[tuple[int, int]]:
    """Register ``[ptr, ptr + nbytes)`` in chunks of at most ``chunk_bytes``.

    Returns the ``(start, nbytes)`` of every registered chunk. If one registration fails, the chunks
    registered so far are unregistered in reverse order and the first error is raised; failures of
    that rollback are chained to it, so nothing is left registered silently.

    Raises:
        InvalidArgumentError: ``nbytes`` or ``chunk_bytes`` not positive.
        KVOffloadError: whatever the pinner raised.
    """
    if nbytes <= 0 or chunk_bytes <= 0:
        raise InvalidArgumentError(
            f"pin_chunks needs positive sizes (nbytes = {nbytes}, chunk_bytes = {chunk_bytes})"
        )
    done: list[tuple[int, int]] = []
    offset = 0
    try:
        while offset < nbytes:
            size = min(chunk_bytes, nbytes - offset)
            pinner.register(ptr + offset, size)
            done.append((ptr + offset, size))
            offset += size
    except BaseException as exc:
        rollback = unpin_chunks(pinner, done)
        if rollback:
            raise KVOffloadError(
                f"pinning failed at offset {offset} and {len(rollback)} chunk(s) could not be "
                f"unregistered: {rollback}"
            ) from exc
        raise
    return done


def unpin_chunks(pinner: HostPinner, chunks: Sequence[tuple[int, int]]) -> list[BaseException]:
    """Unregister chunks in reverse order of registration; returns the failures (never raises)."""
    failures: list[BaseException] = []
    for start, _size in reversed(chunks):
        try:
            pinner.unregister(start)
        except Exception as exc:  # collected: every other chunk must still be released
            failures.append(exc)
    return failures


# ---------------------------------------------------------------------------------------------
# Copy kernel (staged and SM transfer paths)

#: The page-copy kernel. It is handed a per-layout table of segments (see
#: ``_descriptors.kernel_segments``: the same bytes of every block) and, by value in its parameters,
#: the device block and host row of each record it moves, so a job costs the host O(blocks), not
#: O(pages). One warp copies one (row, segment) item at a time, grid-striding over them: 16-byte
#: accesses with four loads in flight per lane, and a byte tail for segments whose size is not a
#: multiple of 16. The host side is device memory (a staging slot) or registered host memory
#: (through its device mapping).
COPY_KERNEL_SOURCE: Final = r"""
struct KvoSegment { long long dev_base, dev_stride, host_offset, nbytes; };
template <int R> struct KvoRows { long long dev[R]; long long host[R]; };

template <int R>
__device__ __forceinline__ void kvo_copy(
    const KvoSegment* __restrict__ segments, unsigned long long num_segments,
    unsigned long long rows, unsigned long long host_base, unsigned long long record_bytes,
    int to_host, const KvoRows<R>& ids)
{
    const unsigned lane = threadIdx.x & 31u;
    const unsigned long long warp =
        ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const unsigned long long warps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;
    const unsigned long long items = rows * num_segments;
    for (unsigned long long item = warp; item < items; item += warps) {
        const unsigned long long row = item / num_segments;
        const KvoSegment seg = segments[item - row * num_segments];
        const unsigned long long dev =
            (unsigned long long)(seg.dev_base + ids.dev[row] * seg.dev_stride);
        const unsigned long long host =
            host_base + (unsigned long long)ids.host[row] * record_bytes
            + (unsigned long long)seg.host_offset;
        const unsigned long long src = to_host ? dev : host;
        const unsigned long long dst = to_host ? host : dev;
        const uint4* __restrict__ s = (const uint4*)src;
        uint4* __restrict__ d = (uint4*)dst;
        const unsigned long long nbytes = (unsigned long long)seg.nbytes;
        const unsigned long long n16 = nbytes >> 4;
        unsigned long long i = lane;
        for (; i + 96 < n16; i += 128) {
            const uint4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
            d[i] = a; d[i + 32] = b; d[i + 64] = c; d[i + 96] = e;
        }
        for (; i < n16; i += 32) d[i] = s[i];
        const unsigned char* sb = (const unsigned char*)src;
        unsigned char* db = (unsigned char*)dst;
        for (unsigned long long j = (n16 << 4) + lane; j < nbytes; j += 32) db[j] = sb[j];
    }
}

#define KVO_ENTRY(NAME, R)                                                                   \
extern "C" __global__ void __launch_bounds__(1024)                                           \
NAME(const KvoSegment* __restrict__ segments, unsigned long long num_segments,               \
     unsigned long long rows, unsigned long long host_base, unsigned long long record_bytes, \
     int to_host, const KvoRows<R> ids)                                                      \
{ kvo_copy<R>(segments, num_segments, rows, host_base, record_bytes, to_host, ids); }

KVO_ENTRY(kvo_copy_blocks, 1024)
KVO_ENTRY(kvo_copy_blocks_small, 32)
"""
#: The kernel's entry points and the records each moves per launch (the size of its by-value id
#: arrays): the large one carries 16 KiB of parameters, the small one 512 bytes, which the driver
#: copies at every launch (a few microseconds less for a job of a few blocks).
COPY_KERNEL_ENTRIES: Final = ((b"kvo_copy_blocks_small", 32), (b"kvo_copy_blocks", 1024))
#: Records one launch of the copy kernel moves at most.
KERNEL_ROWS: Final = COPY_KERNEL_ENTRIES[-1][1]
#: Threads per CTA of the copy kernel.
COPY_KERNEL_THREADS: Final = 512
#: ABI version ``cuLaunchKernel`` is resolved for (its signature is unchanged since CUDA 4.0).
LAUNCH_ABI_VERSION: Final = 12000


def _nvrtc_check(call: str, result: tuple[Any, Unpack[_Ts]]) -> tuple[Unpack[_Ts]]:
    from cuda.bindings import nvrtc

    code = result[0]
    if code != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        message = nvrtc.nvrtcGetErrorString(code)
        text = _decode(message[1]) if len(message) > 1 else str(code)
        raise CudaError(call, int(code), getattr(code, "name", str(code)), text)
    return result[1:]


def _device_attribute(device_index: int, attribute: _drv.CUdevice_attribute) -> int:
    dev = _device_handle(device_index)
    (value,) = _call_driver("cuDeviceGetAttribute", lambda: _drv.cuDeviceGetAttribute(attribute, dev))
    return value


def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of the device."""
    return _device_attribute(
        device_index, _drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    )


def host_pointer_is_device_pointer(device_index: int, host_ptr: int) -> bool:
    """Whether kernels can use the address of registered host memory as is (UVA): the device
    pointer the driver maps it to must be the same address.

    Raises:
        CudaError: the memory is not registered with the device.
    """
    make_context_current(device_index)
    (mapped,) = _call_driver(
        "cuMemHostGetDevicePointer", lambda: _drv.cuMemHostGetDevicePointer(host_ptr, 0)
    )
    return int(mapped) == host_ptr


class CopyKernel:
    """The page-copy kernel, compiled with NVRTC for one device and loaded once per process.

    Owns: the loaded module (kept for the process lifetime, like the primary context: kernels may be
    in flight on any stream until the process ends). Launches go through a :class:`KernelLauncher`
    (one per issuing backend: it owns the parameter buffers).
    """

    def __init__(
        self, device_index: int, functions: tuple[tuple[int, int], ...], launch: Callable[..., int]
    ) -> None:
        self.device_index = device_index
        self.functions = functions  # (function handle, rows per launch), ascending rows
        self.launch_fn = launch

    @classmethod
    @functools.cache
    def for_device(cls, device_index: int) -> CopyKernel:
        """Compile (NVRTC, for the device's compute capability) and load the kernel; cached.

        Raises:
            CudaError: NVRTC or the driver failed (the message carries the compile log).
        """
        make_context_current(device_index)
        major = _device_attribute(
            device_index, _drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        )
        minor = _device_attribute(
            device_index, _drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
        )
        image = _compile(COPY_KERNEL_SOURCE, f"sm_{major}{minor}")
        (module,) = _call_driver("cuModuleLoadData", lambda: _drv.cuModuleLoadData(image))
        functions = []
        for name, rows in COPY_KERNEL_ENTRIES:
            (function,) = _call_driver(
                "cuModuleGetFunction", lambda: _drv.cuModuleGetFunction(module, name)
            )
            functions.append((int(function), rows))
        p, u = ctypes.c_void_p, ctypes.c_uint
        launch = resolve_driver_function(
            b"cuLaunchKernel", LAUNCH_ABI_VERSION, p, u, u, u, u, u, u, u, p, p, p
        )
        return cls(device_index, tuple(functions), launch)

    def launcher(self) -> KernelLauncher:
        """A launcher with parameter buffers of its own (one per issuing backend)."""
        return KernelLauncher(self)


class _LaunchParams:
    """The parameter block of one kernel entry point, built once and refilled per launch."""

    def __init__(self, function: int, rows: int) -> None:
        self.function = function
        self.rows = rows
        self.scalars = (ctypes.c_uint64 * 5)()  # segments, num_segments, rows, host_base, record_bytes
        self.to_host = ctypes.c_int(0)
        self.ids = (ctypes.c_int64 * (2 * rows))()  # KvoRows<rows>: dev[rows] then host[rows]
        self.id_view = np.frombuffer(memoryview(self.ids), dtype=np.int64)
        base = ctypes.addressof(self.scalars)
        addresses = [base + 8 * i for i in range(5)]
        addresses += [ctypes.addressof(self.to_host), ctypes.addressof(self.ids)]
        self.pointers = (ctypes.c_void_p * 7)(*addresses)


class KernelLauncher:
    """Launches the copy kernel with parameter buffers built once.

    Owns: one parameter block per entry point. Not thread-safe: its backend launches from one thread
    at a time (the handler issues one job at a time).
    """

    def __init__(self, kernel: CopyKernel) -> None:
        self.kernel = kernel
        self._params = [_LaunchParams(function, rows) for function, rows in kernel.functions]
        # The launch arguments as ctypes objects, per (entry, CTAs, stream): ctypes then passes
        # them without converting each Python int (a microsecond or more per launch).
        self._arguments: dict[tuple[int, int, int], tuple[Any, ...]] = {}

    def _launch_arguments(self, params: _LaunchParams, ctas: int, stream: int) -> tuple[Any, ...]:
        key = (params.function, ctas, stream)
        arguments = self._arguments.get(key)
        if arguments is None:
            one = ctypes.c_uint(1)
            arguments = self._arguments[key] = (
                ctypes.c_void_p(params.function), ctypes.c_uint(ctas), one, one,
                ctypes.c_uint(COPY_KERNEL_THREADS), one, one, ctypes.c_uint(0),
                ctypes.c_void_p(stream), params.pointers, None,
            )
        return arguments

    def launch(
        self,
        segments_ptr: int,
        num_segments: int,
        device_blocks: npt.NDArray[np.int64],
        host_rows: npt.NDArray[np.int64],
        host_base: int,
        record_bytes: int,
        to_host: bool,
        ctas: int,
        stream: int,
    ) -> None:
        """Copy the pages of ``device_blocks[i]`` to or from row ``host_rows[i]`` of the record
        array at ``host_base`` on ``stream``, with ``ctas`` CTAs of :data:`COPY_KERNEL_THREADS`
        threads. ``segments_ptr`` is the device address of the layout's ``kernel_segments`` table
        (``num_segments`` rows); ``host_base`` is a device address or registered host memory.
        Launches once per :data:`KERNEL_ROWS` records (the ids travel in the launch parameters; a
        launch of at most 32 records uses the entry point with 512 bytes of them).

        Raises:
            InvalidArgumentError: the legacy default stream, a non-positive CTA count, or id arrays
                of different lengths.
            CudaError: a launch failed (earlier launches of the call stay enqueued).
        """
        if stream == _LEGACY_DEFAULT_STREAM:
            raise InvalidArgumentError("kernels are never launched on the legacy default stream (0)")
        if ctas <= 0:
            raise InvalidArgumentError(f"ctas = {ctas} must be positive")
        if device_blocks.shape != host_rows.shape or device_blocks.ndim != 1:
            raise InvalidArgumentError(
                f"device_blocks {device_blocks.shape} and host_rows {host_rows.shape} must be "
                "1-d arrays of one length"
            )
        total = int(device_blocks.shape[0]) if num_segments else 0
        small = self._params[0]
        for start in range(0, total, KERNEL_ROWS):
            count = min(KERNEL_ROWS, total - start)
            params = small if count <= small.rows else self._params[-1]
            scalars = params.scalars
            scalars[0] = segments_ptr
            scalars[1] = num_segments
            scalars[2] = count
            scalars[3] = host_base
            scalars[4] = record_bytes
            params.to_host.value = int(to_host)
            params.id_view[:count] = device_blocks[start : start + count]
            params.id_view[params.rows : params.rows + count] = host_rows[start : start + count]
            _hot_call("cuLaunchKernel", self.kernel.device_index, self.kernel.launch_fn,
                      *self._launch_arguments(params, ctas, stream))


def _compile(source: str, arch: str) -> bytes:
    """CUDA C -> CUBIN for ``arch`` with NVRTC (PTX for the driver to finish when NVRTC cannot
    target the architecture)."""
    from cuda.bindings import nvrtc

    (prog,) = _nvrtc_check(
        "nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(source.encode(), b"kvoffload_copy.cu", 0, [], [])
    )
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
        compiled = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        if compiled[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            (size,) = _nvrtc_check("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise CudaError("nvrtcCompileProgram", int(compiled[0]), "NVRTC_ERROR_COMPILATION",
                            _decode(log).strip("\x00 "))
        (size,) = _nvrtc_check("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
        image = b" " * size
        _nvrtc_check("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, image))
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
