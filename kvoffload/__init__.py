"""kvoffload: offload paged KV-cache blocks from GPU memory to pinned host memory and back.

The public surface is exactly ``__all__``; integrators import from here (and from
``kvoffload.testing`` in their tests). See README.md for a quick start.

Names that need torch, numpy or CUDA (the worker, the layout, the driver bindings, the remote tier)
are imported on first use, so a scheduler process that uses only the :class:`Manager` never imports
torch, and one without a GPU never imports cuda-python.
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
    DiskInUseError,
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
    LayerError,
    LayoutError,
    MissingDependencyError,
    NativeBuildError,
    PolicyError,
    PoolCollisionError,
    PoolMismatchError,
    PoolRankFailedError,
    PoolTimeoutError,
    RegionError,
    RemoteError,
    RemoteIntegrityError,
    RemoteMissError,
    RemoteShutdownError,
    RemoteStoreError,
    RemoteTimeoutError,
    RemoteUnavailableError,
    SharedPoolError,
    ShutdownError,
    TransferError,
    UnknownJobError,
    UnknownKeyError,
    UnknownPolicyError,
    WaitTimeoutError,
)
from kvoffload._layer_load import LayerLoad
from kvoffload.disk.config import (
    DiskCapabilities,
    DiskConfig,
    DiskErrorKind,
    DiskRecordInfo,
    DiskStats,
)
from kvoffload.manager.manager import MAX_TIER_BLOCKS, Manager
from kvoffload.manager.remote import RemoteIndex
from kvoffload.manager.policies import (
    POLICY_NAMES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    PolicyFactory,
)
from kvoffload.manager.records import (
    NAMESPACE_PREFIX_BYTES,
    BlockEvent,
    Demotion,
    DiskRecord,
    EventKind,
    LoadPlan,
    ManagerStats,
    RemotePutPlan,
    StorePlan,
    Tier,
    TierStats,
    namespaced_key,
)
from kvoffload.bindings.types import Capabilities, CopyMethod, SrcAccessOrder
from kvoffload.records import BlockIds, Direction, DriverCallStats, HandlerStats, TransferResult, WorkerStats

if TYPE_CHECKING:
    from kvoffload.layout import DeviceLayout, TensorGeometry
    from kvoffload.pool import PoolRank, PoolRankInfo, PoolView, SharedPool, SharedPoolInfo
    from kvoffload._memory import host_memory_available
    from kvoffload.remote import (
        MooncakeConfig,
        MooncakeStore,
        RedisClusterConfig,
        RedisClusterStore,
        RemoteConfig,
        RemoteErrorKind,
        RemoteResult,
        RemoteStats,
        RemoteStore,
        RemoteTierStats,
        open_remote_index,
    )
    from kvoffload.worker.assembly import BackendName, IssuerName, PathName
    from kvoffload.worker.worker import Worker

__version__ = "0.1.0.dev0"

#: Public names importable lazily, by the module that defines them.
_LAZY: dict[str, str] = {
    "DeviceLayout": "kvoffload.layout",
    "TensorGeometry": "kvoffload.layout",
    "host_memory_available": "kvoffload._memory",
    "PoolRank": "kvoffload.pool",
    "PoolRankInfo": "kvoffload.pool",
    "PoolView": "kvoffload.pool",
    "SharedPool": "kvoffload.pool",
    "SharedPoolInfo": "kvoffload.pool",
    "BackendName": "kvoffload.worker.assembly",
    "PathName": "kvoffload.worker.assembly",
    "IssuerName": "kvoffload.worker.assembly",
    "Worker": "kvoffload.worker.worker",
    "MooncakeConfig": "kvoffload.remote",
    "MooncakeStore": "kvoffload.remote",
    "RedisClusterConfig": "kvoffload.remote",
    "RedisClusterStore": "kvoffload.remote",
    "RemoteConfig": "kvoffload.remote",
    "RemoteErrorKind": "kvoffload.remote",
    "RemoteResult": "kvoffload.remote",
    "RemoteStats": "kvoffload.remote",
    "RemoteStore": "kvoffload.remote",
    "RemoteTierStats": "kvoffload.remote",
    "open_remote_index": "kvoffload.remote",
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
    "DiskRecord",
    "DeviceLayout",
    "DeviceMismatchError",
    "Direction",
    "DiskCapabilities",
    "DiskConfig",
    "DiskError",
    "DiskErrorKind",
    "DiskFormatError",
    "DiskInUseError",
    "DiskIOError",
    "DiskIntegrityError",
    "DiskPathError",
    "DiskRecordInfo",
    "DiskShutdownError",
    "DiskStats",
    "DriverCallStats",
    "DuplicateKeyError",
    "EventKind",
    "EvictionPolicy",
    "HandlerStats",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "IssuerName",
    "JobIdError",
    "KVOffloadError",
    "KeyStateError",
    "KeyTypeError",
    "LRUPolicy",
    "LayerError",
    "LayerLoad",
    "LayoutError",
    "LoadPlan",
    "MAX_TIER_BLOCKS",
    "Manager",
    "MissingDependencyError",
    "NativeBuildError",
    "MooncakeConfig",
    "MooncakeStore",
    "NAMESPACE_PREFIX_BYTES",
    "ManagerStats",
    "POLICY_NAMES",
    "PathName",
    "PolicyError",
    "PolicyFactory",
    "PoolCollisionError",
    "PoolMismatchError",
    "PoolRank",
    "PoolRankFailedError",
    "PoolRankInfo",
    "PoolTimeoutError",
    "PoolView",
    "RedisClusterConfig",
    "RedisClusterStore",
    "RegionError",
    "RemoteConfig",
    "RemoteError",
    "RemoteErrorKind",
    "RemoteIntegrityError",
    "RemoteIndex",
    "RemoteMissError",
    "RemotePutPlan",
    "RemoteResult",
    "RemoteShutdownError",
    "RemoteStats",
    "RemoteStore",
    "RemoteStoreError",
    "RemoteTierStats",
    "RemoteTimeoutError",
    "RemoteUnavailableError",
    "SharedPool",
    "SharedPoolError",
    "SharedPoolInfo",
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
    "host_memory_available",
    "namespaced_key",
    "open_remote_index",
]
