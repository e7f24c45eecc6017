"""The shared host pool: one pool that every tensor-parallel rank of one engine maps (docs/design.md
§13). ``spec`` (``SharedPool``, ``PoolRank``: what the ranks name), ``header`` (the file's header
page and process liveness), ``session`` (one rank's attach: join, agree, populate, map, unlink),
``view`` (``SharedPool.inspect``: the whole pool for tests and operators)."""

from kvoffload.pool.spec import DEFAULT_ATTACH_TIMEOUT_S, PoolRank, SharedPool
from kvoffload.pool.view import PoolRankInfo, PoolView, SharedPoolInfo

__all__ = [
    "DEFAULT_ATTACH_TIMEOUT_S",
    "PoolRank",
    "PoolRankInfo",
    "PoolView",
    "SharedPool",
    "SharedPoolInfo",
]
