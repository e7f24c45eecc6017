"""kvoffload.remote: a tier beyond one machine, on a distributed store, every record verified.

A remote store moves whole host records between the host rows it borrows and the store: each record
is stored as one header page (CRC32 of the payload, layout fingerprint, key, generation; the disk
tier's record header layout) followed by the host record, and verified on every get. Two stores
implement :class:`RemoteStore`: :class:`MooncakeStore` (zero-copy over the registered host rows;
``pip install 'kvoffload[mooncake]'``) and :class:`RedisClusterStore`
(``pip install 'kvoffload[redis]'``). Neither package is imported until a store is created.
"""

from __future__ import annotations

from kvoffload.remote._base import RemoteStoreBase
from kvoffload.remote._types import (
    RemoteErrorKind,
    RemoteOp,
    RemoteResult,
    RemoteStats,
    RemoteStore,
    RemoteTierStats,
)
from kvoffload.remote.config import RemoteConfig, StoreFactory, open_remote_index
from kvoffload.remote.mooncake import MooncakeConfig, MooncakeStore
from kvoffload.remote.redis_cluster import RedisClusterConfig, RedisClusterStore

__all__ = [
    "MooncakeConfig",
    "MooncakeStore",
    "RedisClusterConfig",
    "RedisClusterStore",
    "RemoteConfig",
    "RemoteErrorKind",
    "RemoteOp",
    "RemoteResult",
    "RemoteStats",
    "RemoteStore",
    "RemoteStoreBase",
    "RemoteTierStats",
    "StoreFactory",
    "open_remote_index",
]
