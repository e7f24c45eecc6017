"""kvoffload.remote: a tier beyond one machine, on a distributed store, every record verified.

A remote store moves whole host records between the host rows it borrows and the store: each record
is the record of every tier (:mod:`kvoffload._record`: a header page with the payload's CRC32, the
layout fingerprint, the key and a generation, then the host record), verified on every get. Two
stores implement :class:`RemoteStore`: :class:`MooncakeStore` (zero-copy over the registered host
rows; ``pip install 'kvoffload[mooncake]'``) and :class:`RedisClusterStore`
(``pip install 'kvoffload[redis]'``). Neither package is imported until a store is created. A
Worker's remote tier (``Worker.create(..., remote=RemoteConfig(...))``, :mod:`kvoffload.remote.tier`)
runs ``put_remote``/``get_remote`` jobs on a store; a Manager asks one which keys exist
(:func:`open_remote_index`). docs/design.md §14 has the whole design.
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
