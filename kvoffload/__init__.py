"""kvoffload: offload paged KV-cache blocks from GPU memory to pinned host memory and back.

The public surface is exactly ``__all__``; integrators import from here (and from
``kvoffload.testing`` in their tests). See README.md for a quick start.

Names that need torch or CUDA (the worker, the layout, the bindings) are imported on first use, so
a scheduler process that uses only the :class:`Manager` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload.errors import (
    ArgumentTypeError,
    BlockConflictError,
    BlockIdTypeError,
    ClosedError,
    CudaError,
    DeviceMismatchError,
    DiskError,
    DiskFormatError,
    DiskIntegrityError,
    DiskIOError,
    DiskPathError,
    DiskShutdownError,
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidBlockIdError,
    JobIdError,
    KeyStateError,
    KeyTypeError,
    KVOffloadError,
    LayoutError,
    PolicyError,
    RegionError,
    ShutdownError,
    TransferError,
    UnknownJobError,
    UnknownKeyError,
    UnknownPolicyError,
    WaitTimeoutError,
)
from kvoffload.manager import (
    ARCPolicy,
    BlockEvent,
    Demotion,
    EventKind,
    EvictionPolicy,
    LoadPlan,
    LRUPolicy,
    Manager,
    ManagerStats,
    PolicyFactory,
    StorePlan,
    Tier,
    TierStats,
)
from kvoffload.records import BlockIds, Direction, HandlerStats, TransferResult, WorkerStats

if TYPE_CHECKING:
    from kvoffload.bindings import Capabilities, CopyMethod, SrcAccessOrder
    from kvoffload.disk import (
        DiskCapabilities,
        DiskConfig,
        DiskErrorKind,
        DiskRecordInfo,
        DiskStats,
    )
    from kvoffload.layout import DeviceLayout, TensorGeometry
    from kvoffload.worker import BackendName, PathName, Worker

__version__ = "0.1.0.dev0"

#: Public names importable lazily, by the module that defines them.
_LAZY: dict[str, str] = {
    "Capabilities": "kvoffload.bindings",
    "CopyMethod": "kvoffload.bindings",
    "SrcAccessOrder": "kvoffload.bindings",
    "DeviceLayout": "kvoffload.layout",
    "TensorGeometry": "kvoffload.layout",
    "DiskCapabilities": "kvoffload.disk",
    "DiskConfig": "kvoffload.disk",
    "DiskErrorKind": "kvoffload.disk",
    "DiskRecordInfo": "kvoffload.disk",
    "DiskStats": "kvoffload.disk",
    "BackendName": "kvoffload.worker",
    "PathName": "kvoffload.worker",
    "Worker": "kvoffload.worker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ARCPolicy",
    "ArgumentTypeError",
    "BackendName",
    "BlockConflictError",
    "BlockEvent",
    "BlockIdTypeError",
    "BlockIds",
    "Capabilities",
    "ClosedError",
    "CopyMethod",
    "CudaError",
    "Demotion",
    "DeviceLayout",
    "DeviceMismatchError",
    "Direction",
    "DiskCapabilities",
    "DiskConfig",
    "DiskError",
    "DiskErrorKind",
    "DiskFormatError",
    "DiskIOError",
    "DiskIntegrityError",
    "DiskPathError",
    "DiskRecordInfo",
    "DiskShutdownError",
    "DiskStats",
    "DuplicateKeyError",
    "EventKind",
    "EvictionPolicy",
    "HandlerStats",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "JobIdError",
    "KVOffloadError",
    "KeyStateError",
    "KeyTypeError",
    "LRUPolicy",
    "LayoutError",
    "LoadPlan",
    "Manager",
    "ManagerStats",
    "PathName",
    "PolicyError",
    "PolicyFactory",
    "RegionError",
    "ShutdownError",
    "SrcAccessOrder",
    "StorePlan",
    "TensorGeometry",
    "Tier",
    "TierStats",
    "TransferError",
    "TransferResult",
    "UnknownJobError",
    "UnknownKeyError",
    "UnknownPolicyError",
    "WaitTimeoutError",
    "Worker",
    "WorkerStats",
    "__version__",
]
