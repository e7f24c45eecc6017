"""The copier: a job's copy descriptors handed to the driver with one of three methods.

* ``BATCH_CTYPES``: ``cuMemcpyBatchAsync`` resolved with ``cuGetProcAddress`` for the ABI version
  it is called with (CUDA 13 removed the ``failIdx`` argument) and called through ctypes with numpy
  ``uint64`` arrays, so no per-page Python object is built. The default where available.
* ``BATCH_BINDINGS``: the same driver call through cuda-python's wrapper (one ``CUdeviceptr``
  object per pointer; slower, kept as a cross-check).
* ``PER_COPY``: one ``cuMemcpyAsync`` per copy; the fallback when the driver has no batch memcpy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt
from cuda.bindings import driver as _drv

from kvoffload.bindings.driver import (
    BATCH_ABI_CUDA_13_0,
    LEGACY_DEFAULT_STREAM,
    Capabilities,
    CopyMethod,
    SrcAccessOrder,
    call_driver,
    checked_code,
    memcpy_async,
    resolve_batch_symbol,
)
from kvoffload.errors import InvalidArgumentError

__all__ = ["BATCH_FIRST_COPIES", "BATCH_MAX_COPIES", "COPY_PIECE_BYTES", "Copier", "in_pieces"]

U64Array = npt.NDArray[np.uint64]
#: Copies per driver call; a longer job is issued as several batches on the same stream.
BATCH_MAX_COPIES: Final = 1 << 16
#: Copies of the first driver call of a :meth:`Copier.copy`, each next call taking twice as many
#: (up to :data:`BATCH_MAX_COPIES`): the copy engine starts on a call's copies only once the call
#: returned, and the driver spends about 0.37 us a copy, so one call of a thousand copies held the
#: first byte for 350-380 us on an H100 host (docs/design.md §16, *Descriptors in growing calls*).
#: The native issuer's ``BATCH_FIRST`` is the same.
BATCH_FIRST_COPIES: Final = 64
#: The longest copy a path issues: a longer one (a long page or record, or a run merged from pages
#: or records that continue each other) goes as pieces of this size cut from its start, by the
#: Python paths (:func:`in_pieces`) and the native issuer alike. The copy engine can take another
#: stream's copy in the same direction (the expedited load lane's) only between copies: a piece is
#: about 38 us at 55 GB/s, a whole staged chunk (a slot, 64 MiB by default) 1.2 ms. Measured on the
#: H200, at 2 MiB it took the lane's copy between pieces only where the device's queues let it (in
#: one process of six), while a staged 64 MiB job alone at 4 and 64 KiB pages took about 5% longer
#: and its caller's call about twice as long: so 0, no bound, the default (docs/design.md §4,
#: *Copies in pieces*). Read when a copy is issued (Python issuer) or an issuer is started (native).
COPY_PIECE_BYTES = 0


def in_pieces(dsts: U64Array, srcs: U64Array, sizes: U64Array,
              piece: int) -> tuple[U64Array, U64Array, U64Array]:
    """The same copies with every one longer than ``piece`` bytes split into pieces of ``piece``
    bytes (the last one shorter), in order; unchanged when ``piece`` is 0 or none is longer."""
    if piece <= 0 or not bool((sizes > piece).any()):
        return dsts, srcs, sizes
    size = sizes.astype(np.int64)
    counts = (size + piece - 1) // piece
    owner = np.repeat(np.arange(size.shape[0]), counts)
    first = np.cumsum(counts) - counts
    offset = ((np.arange(owner.shape[0]) - first[owner]) * piece).astype(np.uint64)
    return (np.ascontiguousarray(dsts[owner] + offset), np.ascontiguousarray(srcs[owner] + offset),
            np.ascontiguousarray(np.minimum(sizes[owner] - offset, np.uint64(piece))))

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
        self.symbol = symbol  # cuMemcpyBatchAsync's address, for batch-ctypes (and the native issuer)
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
        symbol = resolve_batch_symbol(caps.batch_abi_version) if caps.batch_abi_version else None
        return cls(chosen, caps.batch_abi_version, symbol, caps.device_index)

    @property
    def abi_version(self) -> int | None:
        """The ABI version ``cuMemcpyBatchAsync`` was resolved for (None: no batch call)."""
        return self._abi_version

    def attrs_pointer(self, order: SrcAccessOrder) -> int:
        """The address of the ``CUmemcpyAttributes`` of ``order`` (kept alive with the copier)."""
        return int(self._attrs_ptr[order])

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
        the batch call costs the host several times more for one descriptor. A copy longer than
        :data:`COPY_PIECE_BYTES` goes as pieces of it (:func:`in_pieces`).

        Raises:
            InvalidArgumentError: the legacy default stream, or malformed arrays.
            CudaError: the driver refused the copies. Copies of earlier batches of the same call
                may already be enqueued; the caller must still wait for the stream before reusing
                the buffers.
        """
        if stream == LEGACY_DEFAULT_STREAM:
            raise InvalidArgumentError("copies are never issued on the legacy default stream (0)")
        count = len(dsts)
        if not (len(srcs) == count == len(sizes)):
            raise InvalidArgumentError(
                f"descriptor arrays differ in length: dsts {count}, srcs {len(srcs)}, sizes {len(sizes)}"
            )
        dsts, srcs, sizes = in_pieces(dsts, srcs, sizes, COPY_PIECE_BYTES)
        count = len(dsts)
        if count == 1 and self.method is CopyMethod.BATCH_CTYPES:
            memcpy_async(int(dsts[0]), int(srcs[0]), int(sizes[0]), stream, self.device_index)
            return
        start, most = 0, BATCH_FIRST_COPIES
        while start < count:
            stop = min(count, start + most)
            most = min(2 * most, BATCH_MAX_COPIES)
            if self.method is CopyMethod.BATCH_CTYPES:
                self._copy_ctypes(dsts[start:stop], srcs[start:stop], sizes[start:stop], order, stream)
            elif self.method is CopyMethod.BATCH_BINDINGS:
                self._copy_bindings(dsts[start:stop], srcs[start:stop], sizes[start:stop], order, stream)
            else:
                self._copy_loop(dsts[start:stop], srcs[start:stop], sizes[start:stop], stream)
            start = stop

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
        checked_code("cuMemcpyBatchAsync", code)

    def _copy_bindings(
        self, dsts: U64Array, srcs: U64Array, sizes: U64Array, order: SrcAccessOrder, stream: int
    ) -> None:
        d = [_drv.CUdeviceptr(int(x)) for x in dsts]
        s = [_drv.CUdeviceptr(int(x)) for x in srcs]
        n = [int(x) for x in sizes]
        call_driver(
            "cuMemcpyBatchAsync",
            lambda: _drv.cuMemcpyBatchAsync(
                d, s, n, len(d), [self._attrs[order]], [0], 1, _drv.CUstream(stream)
            ),
        )

    def _copy_loop(self, dsts: U64Array, srcs: U64Array, sizes: U64Array, stream: int) -> None:
        handle = _drv.CUstream(stream)
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            call_driver(
                "cuMemcpyAsync",
                lambda: _drv.cuMemcpyAsync(
                    _drv.CUdeviceptr(dst), _drv.CUdeviceptr(src), size, handle
                ),
            )


def _make_attrs(order: SrcAccessOrder) -> _drv.CUmemcpyAttributes:
    attrs_struct = _drv.CUmemcpyAttributes()
    attrs_struct.srcAccessOrder = _drv.CUmemcpySrcAccessOrder(int(order))
    return attrs_struct

