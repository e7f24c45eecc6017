"""Checked CUDA driver calls: results, capabilities, contexts, streams, events, registration.

Owns the CUDA facts the rest of the library relies on: which driver calls exist, how their results
are checked, which source access order each direction uses. Every ``CUresult`` is checked at the
call and turned into a :class:`~kvoffload.errors.CudaError` naming the call, the error name and the
driver's message; ``CUDA_ERROR_NOT_READY`` from a query is a normal answer. The calls a job's
submission makes (event record, query and wait, a single copy, the kernel launch) are resolved with
``cuGetProcAddress`` and called through ctypes: about a microsecond each.

The legacy default stream (handle 0) is refused for every copy and launch: batch memcpy rejects it,
and work on it would serialise with every other stream.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any, Final

from cuda.bindings import driver as _drv
from typing_extensions import TypeVarTuple, Unpack

from kvoffload.bindings.types import Capabilities, CopyMethod, SrcAccessOrder
from kvoffload.errors import CudaError, InvalidArgumentError

__all__ = [
    "HOST_REGISTER_DEVICEMAP",
    "HOST_REGISTER_PORTABLE",
    "LEGACY_DEFAULT_STREAM",
    "Capabilities",
    "CopyMethod",
    "CudaHostPinner",
    "Event",
    "EventPool",
    "SrcAccessOrder",
    "capabilities",
    "check",
    "create_stream",
    "destroy_stream",
    "elapsed_seconds",
    "ensure_context_current",
    "entry_point",
    "event_pool",
    "host_pointer_is_device_pointer",
    "make_context_current",
    "memcpy_async",
    "multiprocessor_count",
    "primary_context",
    "resolve_driver_function",
    "synchronize_device",
]


_Ts = TypeVarTuple("_Ts")

#: cuMemHostRegister flags (plain ints in cuda-python).
HOST_REGISTER_PORTABLE: Final = 1
HOST_REGISTER_DEVICEMAP: Final = 2
#: Driver versions (1000 * major + 10 * minor) of the two batch memcpy C ABIs.
BATCH_ABI_CUDA_12_8: Final = 12080
BATCH_ABI_CUDA_13_0: Final = 13000
#: The legacy default stream's handle: never used for copies or launches.
LEGACY_DEFAULT_STREAM: Final = 0
_DEVICE_NAME_BYTES: Final = 256


def _error_text(code: _drv.CUresult) -> tuple[str, str]:
    """The driver's name and description of an error (the enum's name when the driver is gone)."""
    try:
        name_res = _drv.cuGetErrorName(code)
        text_res = _drv.cuGetErrorString(code)
    except RuntimeError:  # no driver library to ask
        return code.name, "no description: the CUDA driver library is not available"
    name = decode(name_res[1]) if int(name_res[0]) == 0 else code.name
    text = decode(text_res[1]) if int(text_res[0]) == 0 else "no description from the driver"
    return name, text


def decode(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def raise_for(call: str, code: _drv.CUresult) -> None:
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
        raise_for(call, code)
    return result[1:]


def checked_code(call: str, code: int) -> None:
    """Check a raw ``CUresult`` integer returned through ctypes."""
    if code != 0:
        raise_for(call, _drv.CUresult(code))


def call_driver(
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


_init_lock = threading.Lock()
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
            call_driver("cuInit", lambda: _drv.cuInit(0))
            dev = device_handle(device_index)
            (retained,) = call_driver(
                "cuDevicePrimaryCtxRetain", lambda: _drv.cuDevicePrimaryCtxRetain(dev)
            )
            ctx = retained
            _primary_contexts[device_index] = ctx
    call_driver("cuCtxSetCurrent", lambda: _drv.cuCtxSetCurrent(ctx))


def primary_context(device_index: int) -> int:
    """The handle of the device's primary context (retained once for the process, made current in
    the calling thread if it was not known yet).

    Raises:
        CudaError: the driver could not retain it.
    """
    if device_index not in _primary_contexts:
        make_context_current(device_index)
    return int(_primary_contexts[device_index])


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


def device_handle(device_index: int) -> _drv.CUdevice:
    (dev,) = call_driver("cuDeviceGet", lambda: _drv.cuDeviceGet(device_index))
    return dev


@functools.cache
def capabilities(device_index: int) -> Capabilities:
    """Detect driver version, device name and batch memcpy support for one device (cached).

    Raises:
        CudaError: no usable driver or device.
    """
    make_context_current(device_index)
    (version,) = call_driver("cuDriverGetVersion", _drv.cuDriverGetVersion)
    dev = device_handle(device_index)
    (raw_name,) = call_driver(
        "cuDeviceGetName", lambda: _drv.cuDeviceGetName(_DEVICE_NAME_BYTES, dev)
    )
    name = decode(raw_name).split("\x00", 1)[0]
    notes: list[str] = []
    abi = _batch_abi_for(version)
    pointer = resolve_batch_symbol(abi) if abi is not None else None
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
def resolve_batch_symbol(abi_version: int) -> int | None:
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
    (stream,) = call_driver(
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
    call_driver("cuStreamDestroy", lambda: _drv.cuStreamDestroy(_drv.CUstream(handle)))


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
            call_driver("cuCtxSynchronize", _drv.cuCtxSynchronize)
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
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(entry_point(name, abi_version))


def entry_point(name: bytes, abi_version: int) -> int:
    """The address of a driver entry point (``cuGetProcAddress`` for ``abi_version``): what
    :func:`resolve_driver_function` calls through, and what the native issuer is handed.

    Raises:
        CudaError: the driver does not provide the symbol for that version.
    """
    try:
        result = _drv.cuGetProcAddress(name, abi_version, 0)
    except RuntimeError as exc:  # no driver library
        raise CudaError("cuGetProcAddress", -1, "DRIVER_UNAVAILABLE", str(exc)) from exc
    address = int(result[1]) if int(result[0]) == 0 and result[1] is not None else 0
    if not address:
        raise CudaError("cuGetProcAddress", int(result[0]), decode(name), "symbol not found")
    return address


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


def hot_call(call: str, device_index: int, fn: Callable[..., int], *args: Any) -> int:
    """Run a ctypes driver call; on a thread with no current context, make the device's current and
    retry once. Returns the ``CUresult`` (``NOT_READY`` included); raises on any other error."""
    code = fn(*args)
    if code == _INVALID_CONTEXT:
        make_context_current(device_index)
        code = fn(*args)
    if code != 0 and code != _NOT_READY:
        raise_for(call, _drv.CUresult(code))
    return code


def elapsed_seconds(start: int, end: int, device_index: int) -> float:
    """Device time between two completed timing events (``cuEventElapsedTime``), in seconds.

    Raises:
        CudaError: an event is not complete or was made without timing.
    """
    ms = ctypes.c_float(0.0)
    hot_call("cuEventElapsedTime", device_index, _hot().event_elapsed, ctypes.byref(ms), start, end)
    return float(ms.value) / 1e3


def memcpy_async(dst: int, src: int, nbytes: int, stream: int, device_index: int) -> None:
    """One stream-ordered copy (``cuMemcpyAsync``): its source is read after every earlier wait on
    ``stream``, as with :attr:`SrcAccessOrder.STREAM`.

    Raises:
        InvalidArgumentError: the legacy default stream.
        CudaError: the driver refused.
    """
    if stream == LEGACY_DEFAULT_STREAM:
        raise InvalidArgumentError("copies are never issued on the legacy default stream (0)")
    hot_call("cuMemcpyAsync", device_index, _hot().memcpy_async, dst, src, nbytes, stream)


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
        hot_call("cuEventCreate", self.device_index, _hot().event_create, ctypes.byref(handle), flags)
        return int(handle.value or 0)

    def give(self, event: int) -> None:
        """Return an event nothing will wait on or query any more (its last record may still be
        pending: a later record replaces it). Never raises."""
        if len(self._free) < EVENT_POOL_MAX_FREE:
            self._free.append(event)
            return
        self.destroy(event)

    def destroy(self, event: int) -> None:
        """Destroy an event instead of giving it back (one the driver refused to record: a fault
        tied to it would come back to its next taker). Never raises."""
        try:
            hot_call("cuEventDestroy", self.device_index, _hot().event_destroy, event)
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
    """One event taken from an :class:`EventPool`, given back by :meth:`release`.

    Owns: its event, from construction until :meth:`release` (called exactly once by its owner: the
    handler for a ticket whose result it read, for a fence once the last job waiting on it was
    issued; the backend for a marker right after its stream wait was enqueued — a stream wait
    captures the record it was enqueued after — and for its slot events when it is released). An
    event that is never released is simply not reused: no finalizer returns it.
    """

    __slots__ = ("handle", "device_index", "_pool")

    def __init__(self, pool: EventPool) -> None:
        self.handle = pool.take()
        self.device_index = pool.device_index
        self._pool: EventPool | None = pool

    def record(self, stream: int) -> None:
        """Record on ``stream`` (replacing the previous record). Raises :class:`CudaError`."""
        hot_call("cuEventRecord", self.device_index, _hot().event_record, self.handle, stream)

    def wait_on(self, stream: int) -> None:
        """Make ``stream`` wait for this event's current record. Raises :class:`CudaError`."""
        hot_call("cuStreamWaitEvent", self.device_index, _hot().stream_wait_event, stream,
                 self.handle, 0)

    def done(self) -> bool:
        """Whether the current record completed; never blocks. Raises :class:`CudaError`."""
        return hot_call("cuEventQuery", self.device_index, _hot().event_query, self.handle) == 0

    def seconds_until(self, end: Event) -> float:
        """Device seconds from this event to ``end`` (both timing events, both complete)."""
        return elapsed_seconds(self.handle, end.handle, self.device_index)

    def release(self) -> None:
        """Give the event back to its pool: nothing may wait on or query it afterwards (its last
        record may still be pending: a later record replaces it). A second call does nothing."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.give(self.handle)

    def discard(self) -> None:
        """Destroy the event instead of giving it back (see :meth:`EventPool.destroy`); after
        :meth:`release`, or a second call, nothing happens."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.destroy(self.handle)


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
        call_driver("cuMemHostRegister", lambda: _drv.cuMemHostRegister(ptr, nbytes, self.FLAGS))

    def unregister(self, ptr: int) -> None:
        """``cuMemHostUnregister(ptr)``; raises :class:`CudaError`."""
        make_context_current(self.device_index)
        call_driver("cuMemHostUnregister", lambda: _drv.cuMemHostUnregister(ptr))



def device_attribute(device_index: int, attribute: _drv.CUdevice_attribute) -> int:
    dev = device_handle(device_index)
    (value,) = call_driver("cuDeviceGetAttribute", lambda: _drv.cuDeviceGetAttribute(attribute, dev))
    return value


def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of the device."""
    return device_attribute(
        device_index, _drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    )


def host_pointer_is_device_pointer(device_index: int, host_ptr: int) -> bool:
    """Whether kernels can use the address of registered host memory as is (UVA): the device
    pointer the driver maps it to must be the same address.

    Raises:
        CudaError: the memory is not registered with the device.
    """
    make_context_current(device_index)
    (mapped,) = call_driver(
        "cuMemHostGetDevicePointer", lambda: _drv.cuMemHostGetDevicePointer(host_ptr, 0)
    )
    return int(mapped) == host_ptr


def stream_wait_word(device_index: int, stream: int, host_word: int) -> None:
    """Enqueue on ``stream`` a wait, on the device, until the 32-bit word of pinned host memory at
    ``host_word`` is at least 1 (``cuStreamWaitValue32``): work enqueued after it runs only once the
    host sets the word. The word's memory must outlive the wait.

    Raises:
        CudaError: the memory is not pinned for the device, or the driver refused the wait.
    """
    make_context_current(device_index)
    (address,) = call_driver(
        "cuMemHostGetDevicePointer", lambda: _drv.cuMemHostGetDevicePointer(host_word, 0)
    )
    geq = _drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    call_driver(
        "cuStreamWaitValue32",
        lambda: _drv.cuStreamWaitValue32(_drv.CUstream(stream), address, 1, geq),
    )
