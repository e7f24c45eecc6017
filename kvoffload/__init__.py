"""kvoffload: offload paged KV-cache blocks from GPU memory to pinned host memory and back.

The public surface is exactly ``__all__``; integrators import from here (and from
``kvoffload.testing`` in their tests). See README.md for a quick start.
"""

from kvoffload.bindings import Capabilities, CopyMethod, SrcAccessOrder
from kvoffload.errors import (
    ArgumentTypeError,
    BlockConflictError,
    BlockIdTypeError,
    ClosedError,
    CudaError,
    DeviceMismatchError,
    InvalidArgumentError,
    InvalidBlockIdError,
    JobIdError,
    KVOffloadError,
    LayoutError,
    RegionError,
    ShutdownError,
    TransferError,
    UnknownJobError,
    WaitTimeoutError,
)
from kvoffload.layout import DeviceLayout, TensorGeometry
from kvoffload.records import Direction, HandlerStats, TransferResult, WorkerStats
from kvoffload.worker import Worker

__version__ = "0.1.0.dev0"

__all__ = [
    "ArgumentTypeError",
    "BlockConflictError",
    "BlockIdTypeError",
    "Capabilities",
    "ClosedError",
    "CopyMethod",
    "CudaError",
    "DeviceLayout",
    "DeviceMismatchError",
    "Direction",
    "HandlerStats",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "JobIdError",
    "KVOffloadError",
    "LayoutError",
    "RegionError",
    "ShutdownError",
    "SrcAccessOrder",
    "TensorGeometry",
    "TransferError",
    "TransferResult",
    "UnknownJobError",
    "WaitTimeoutError",
    "Worker",
    "WorkerStats",
    "__version__",
]
