"""RemoteConfig: which remote store a Worker (or a Manager's remote index) uses, and its deadline.

A plain value, validated at construction (typed errors naming the field). The store is named by its
own config (:class:`~kvoffload.remote.MooncakeConfig` or :class:`~kvoffload.remote.RedisClusterConfig`),
or injected as a factory ``(host_rows, fingerprint) -> RemoteStore`` (tests, or an integrator's own
store); :func:`open_store` builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Union

import attrs
import numpy as np
from typing_extensions import TypeAlias

from kvoffload._record import PAGE_BYTES
from kvoffload.errors import ArgumentTypeError, InvalidArgumentError
from kvoffload.remote._args import as_timeout
from kvoffload.remote._types import RemoteStore
from kvoffload.remote.mooncake import MooncakeConfig, MooncakeStore
from kvoffload.remote.redis_cluster import RedisClusterConfig, RedisClusterStore

__all__ = ["DEFAULT_JOB_TIMEOUT_S", "RemoteConfig", "StoreFactory", "open_remote_index", "open_store"]

#: ``(host_rows, fingerprint) -> store``: builds a store over borrowed host rows (injection seam).
StoreFactory: TypeAlias = Callable[[object, str], RemoteStore]
StoreChoice: TypeAlias = Union[MooncakeConfig, RedisClusterConfig, StoreFactory]

#: Deadline of one put_remote/get_remote job, from its submission, unless configured.
DEFAULT_JOB_TIMEOUT_S: Final = 30.0


def _check_store(_: RemoteConfig, __: attrs.Attribute[StoreChoice], store: StoreChoice) -> None:
    if isinstance(store, (MooncakeConfig, RedisClusterConfig)) or callable(store):
        return
    raise ArgumentTypeError(
        f"RemoteConfig.store must be a MooncakeConfig, a RedisClusterConfig or a factory "
        f"(host_rows, fingerprint) -> RemoteStore, got {type(store).__name__}"
    )


def _check_seconds(_: RemoteConfig, attribute: attrs.Attribute[float], value: float) -> None:
    as_timeout(value, f"RemoteConfig.{attribute.name}", positive=True)


@attrs.frozen
class RemoteConfig:
    """A remote tier: the store to use and the deadlines of its jobs.

    Attributes:
        store: which store, by its config (``MooncakeConfig(...)`` or ``RedisClusterConfig(...)``), or
            a factory ``(host_rows, fingerprint) -> RemoteStore`` that builds one over the rows.
        job_timeout_s: deadline of each ``put_remote``/``get_remote`` job, counted from its
            submission (queueing included): a job not finished by then is ``ok=False`` with a
            :class:`~kvoffload.errors.RemoteTimeoutError`.
    """

    store: StoreChoice = attrs.field(validator=_check_store)
    job_timeout_s: float = attrs.field(default=DEFAULT_JOB_TIMEOUT_S, validator=_check_seconds)


def open_store(config: RemoteConfig, *, host_rows: object, fingerprint: str) -> RemoteStore:
    """Build the store ``config`` names over ``host_rows`` (borrowed), for ``fingerprint``.

    Raises:
        ArgumentTypeError: ``config`` is not a RemoteConfig; the store's own argument errors.
        RemoteUnavailableError: the store's package is missing or its cluster cannot be joined.
    """
    if not isinstance(config, RemoteConfig):
        raise ArgumentTypeError(f"remote must be a RemoteConfig or None, got {type(config).__name__}")
    store = config.store
    if isinstance(store, MooncakeConfig):
        return MooncakeStore.create(store, host_rows=host_rows, fingerprint=fingerprint)
    if isinstance(store, RedisClusterConfig):
        return RedisClusterStore.create(store, host_rows=host_rows, fingerprint=fingerprint)
    return store(host_rows, fingerprint)


def open_remote_index(config: RemoteConfig, *, fingerprint: str) -> RemoteStore:
    """A store for a scheduler's :class:`~kvoffload.Manager` (``Manager.create(..., remote=...)``),
    which only asks which keys exist: it is built over one scratch host row of its own. The caller
    owns it and closes it (``close``) after the manager's last lookup.

    Raises: as :func:`open_store`; ``ArgumentTypeError`` / ``InvalidArgumentError`` for a
    ``fingerprint`` that is not a non-empty str.
    """
    if not isinstance(fingerprint, str):
        raise ArgumentTypeError(
            f"fingerprint = {fingerprint!r:.80} must be a str (the Manager's, as its stores use it), "
            f"not a {type(fingerprint).__name__}"
        )
    if not fingerprint:
        raise InvalidArgumentError("fingerprint = '' must not be empty")
    return open_store(config, host_rows=np.zeros((1, PAGE_BYTES), dtype=np.uint8), fingerprint=fingerprint)
