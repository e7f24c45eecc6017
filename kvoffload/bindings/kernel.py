"""The page-copy kernel of the staged and SM transfer paths: compiled with NVRTC at run time,
loaded once per device, launched with parameter buffers built once.

Every NVRTC and driver result is checked; a failed compile raises a
:class:`~kvoffload.errors.CudaError` carrying the compile log. The kernel is compiled to a CUBIN for
the device's own architecture (there is no PTX fallback: NVRTC must know the architecture).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from cuda.bindings import driver as _drv
from typing_extensions import TypeVarTuple, Unpack

from kvoffload.bindings.driver import (
    LEGACY_DEFAULT_STREAM,
    call_driver,
    decode,
    device_attribute,
    hot_call,
    make_context_current,
    resolve_driver_function,
)
from kvoffload.errors import CudaError, InvalidArgumentError

__all__ = ["COPY_KERNEL_THREADS", "KERNEL_ROWS", "CopyKernel", "KernelLauncher"]

_Ts = TypeVarTuple("_Ts")


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
KVO_ENTRY(kvo_copy_blocks_mid, 128)
"""
#: The kernel's entry points and the records each moves per launch (the size of its by-value id
#: arrays): the large one carries 16 KiB of parameters, the mid one 2 KiB, the small one 512 bytes,
#: which the driver copies at every launch; a launch uses the smallest that holds its records.
COPY_KERNEL_ENTRIES: Final = (
    (b"kvo_copy_blocks_small", 32), (b"kvo_copy_blocks_mid", 128), (b"kvo_copy_blocks", 1024),
)
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
        text = decode(message[1]) if len(message) > 1 else str(code)
        raise CudaError(call, int(code), getattr(code, "name", str(code)), text)
    return result[1:]




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
        major = device_attribute(
            device_index, _drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        )
        minor = device_attribute(
            device_index, _drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
        )
        image = _compile(COPY_KERNEL_SOURCE, f"sm_{major}{minor}")
        (module,) = call_driver("cuModuleLoadData", lambda: _drv.cuModuleLoadData(image))
        functions = []
        for name, rows in COPY_KERNEL_ENTRIES:
            (function,) = call_driver(
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
        (``num_segments`` rows); ``host_base`` is a device address or registered host memory, and
        ``record_bytes`` the bytes from one of its rows to the next (a record, or a shared pool's
        block).
        Launches once per :data:`KERNEL_ROWS` records (the ids travel in the launch parameters; a
        launch uses the smallest entry point that holds its records: 512 bytes of ids up to 32, 2 KiB up
        to 128).

        Raises:
            InvalidArgumentError: the legacy default stream, a non-positive CTA count, or id arrays
                of different lengths.
            CudaError: a launch failed (earlier launches of the call stay enqueued).
        """
        if stream == LEGACY_DEFAULT_STREAM:
            raise InvalidArgumentError("kernels are never launched on the legacy default stream (0)")
        if ctas <= 0:
            raise InvalidArgumentError(f"ctas = {ctas} must be positive")
        if device_blocks.shape != host_rows.shape or device_blocks.ndim != 1:
            raise InvalidArgumentError(
                f"device_blocks {device_blocks.shape} and host_rows {host_rows.shape} must be "
                "1-d arrays of one length"
            )
        total = int(device_blocks.shape[0]) if num_segments else 0
        for start in range(0, total, KERNEL_ROWS):
            count = min(KERNEL_ROWS, total - start)
            params = next(p for p in self._params if p.rows >= count)  # the smallest that fits
            scalars = params.scalars
            scalars[0] = segments_ptr
            scalars[1] = num_segments
            scalars[2] = count
            scalars[3] = host_base
            scalars[4] = record_bytes
            params.to_host.value = int(to_host)
            params.id_view[:count] = device_blocks[start : start + count]
            params.id_view[params.rows : params.rows + count] = host_rows[start : start + count]
            hot_call("cuLaunchKernel", self.kernel.device_index, self.kernel.launch_fn,
                      *self._launch_arguments(params, ctas, stream))


def _compile(source: str, arch: str) -> bytes:
    """CUDA C -> CUBIN for ``arch`` with NVRTC; every NVRTC result is checked.

    Raises:
        CudaError: NVRTC failed (a compile error carries the compile log).
    """
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
            _nvrtc_check("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, log))
            raise CudaError("nvrtcCompileProgram", int(compiled[0]), "NVRTC_ERROR_COMPILATION",
                            decode(log).strip("\x00 "))
        (size,) = _nvrtc_check("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
        image = b" " * size
        _nvrtc_check("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, image))
    except BaseException:
        nvrtc.nvrtcDestroyProgram(prog)  # the failure above is the one to report
        raise
    _nvrtc_check("nvrtcDestroyProgram", nvrtc.nvrtcDestroyProgram(prog))
    return image
