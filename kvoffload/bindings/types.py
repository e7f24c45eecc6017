"""The driver's vocabulary that kvoffload's public API names: how copies read their source, how
descriptors reach the driver, and what a device can do. Importable without cuda-python, so that a
process without the ``cuda`` extra (a scheduler, a CPU machine) can name them; the calls that produce
and use them live in :mod:`kvoffload.bindings.driver`.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["Capabilities", "CopyMethod", "SrcAccessOrder"]


class SrcAccessOrder(enum.IntEnum):
    """``CUmemcpySrcAccessOrder``: when the driver may read a copy's source.

    ``STREAM`` reads in stream order, after every earlier wait on the stream: mandatory for stores,
    whose source is device memory that compute may still be writing. ``ANY`` lets the driver read the
    source at any time after the call; it is allowed for loads only because their source is pinned
    host memory that no stream writes while the load is in flight (docs/design.md §5 rule 3).
    """

    STREAM = 1
    DURING_API_CALL = 2
    ANY = 3


class CopyMethod(enum.Enum):
    """How a set of copy descriptors is handed to the driver (see the module docstring)."""

    BATCH_CTYPES = "batch-ctypes"
    BATCH_BINDINGS = "batch-bindings"
    PER_COPY = "per-copy"


@attrs.frozen
class Capabilities:
    """What this process can do on one device, detected once at start.

    Attributes:
        device_index: CUDA ordinal.
        device_name: the driver's name for it.
        driver_version: ``cuDriverGetVersion`` (1000 * major + 10 * minor).
        batch_memcpy: ``cuMemcpyBatchAsync`` is usable (driver >= 12.8 and the symbol resolves).
        batch_abi_version: the ABI version the ctypes path resolved the symbol with, or None.
        copy_method: the method a worker uses by default.
        notes: human-readable reasons for any fallback.
    """

    device_index: int
    device_name: str
    driver_version: int
    batch_memcpy: bool
    batch_abi_version: int | None
    copy_method: CopyMethod
    notes: tuple[str, ...] = ()
