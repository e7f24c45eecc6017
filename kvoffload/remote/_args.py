"""Argument checks of the remote tier: timeouts, host rows, keys, row ids, generations, options.

Each raises a typed error naming the argument, the value and the rule, before anything is submitted
(``ArgumentTypeError``/``KeyTypeError``/``BlockIdTypeError`` for a wrong type,
``InvalidArgumentError``/``InvalidBlockIdError``/``DuplicateKeyError`` for a wrong value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvoffload._seconds import as_timeout
from kvoffload._record import MAX_KEY_BYTES, PAGE_BYTES, check_fingerprint
from kvoffload.errors import (
    ArgumentTypeError,
    BlockIdTypeError,
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidBlockIdError,
    KeyTypeError,
)

__all__ = [
    "DEFAULT_BATCH_RECORDS",
    "DEFAULT_CHECKSUM_THREADS",
    "MAX_BATCH_RECORDS",
    "MAX_CHECKSUM_THREADS",
    "as_generations",
    "as_host_rows",
    "as_int",
    "as_keys",
    "as_rows",
    "as_timeout",
    "check_common",
    "check_fingerprint",
]

U8Array = npt.NDArray[np.uint8]
I64Array = npt.NDArray[np.int64]

#: Records per client call unless configured.
DEFAULT_BATCH_RECORDS: Final = 32
MAX_BATCH_RECORDS: Final = 4096
DEFAULT_CHECKSUM_THREADS: Final = 2
MAX_CHECKSUM_THREADS: Final = 64


def as_host_rows(rows: object) -> U8Array:
    """The host rows as a ``uint8[n, record_bytes]`` numpy view (no copy).

    Accepts a numpy array or a CPU torch tensor (pinned or not) of that shape and dtype, C-contiguous,
    with ``record_bytes`` a positive multiple of 4096.

    Raises:
        ArgumentTypeError: another type or dtype; InvalidArgumentError: another shape, not
        contiguous, or a record size that is not a positive multiple of 4096.
    """
    array: Any = rows
    if type(rows).__module__.startswith("torch"):
        if getattr(rows, "device", None) is None or str(getattr(rows, "device")) != "cpu":
            raise ArgumentTypeError(f"host_rows must be a CPU tensor, got one on {getattr(rows, 'device', '?')}")
        array = rows.numpy()  # type: ignore[attr-defined]
    if not isinstance(array, np.ndarray):
        raise ArgumentTypeError(
            f"host_rows must be a numpy array or a CPU torch tensor, got {type(rows).__name__}"
        )
    if array.dtype != np.uint8:
        raise ArgumentTypeError(f"host_rows must have dtype uint8, got {array.dtype}")
    if array.ndim != 2 or array.shape[0] < 1:
        raise InvalidArgumentError(f"host_rows must be 2-D [num_rows >= 1, record_bytes], got shape {array.shape}")
    if not array.flags.c_contiguous:
        raise InvalidArgumentError("host_rows must be C-contiguous (one record per row, back to back)")
    record_bytes = int(array.shape[1])
    if record_bytes % PAGE_BYTES:
        raise InvalidArgumentError(
            f"host_rows has {record_bytes} bytes per row; a host record is a multiple of {PAGE_BYTES}"
        )
    return array


def as_int(name: str, value: object, low: int, high: int) -> int:
    """An int in ``[low, high]`` (not a bool); ``name`` is named in the error."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
    if not low <= int(value) <= high:
        raise InvalidArgumentError(f"{name} = {value} must be in [{low}, {high}]")
    return int(value)


def check_common(batch_records: object, checksum_threads: object) -> tuple[int, int]:
    """Check the options every store shares; returns them as ints."""
    return (
        as_int("batch_records", batch_records, 1, MAX_BATCH_RECORDS),
        as_int("checksum_threads", checksum_threads, 1, MAX_CHECKSUM_THREADS),
    )


def as_keys(keys: object, *, unique: bool) -> list[bytes]:
    """A sequence of 1..MAX_KEY_BYTES-byte keys as a list (with ``unique``, no key twice)."""
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise KeyTypeError(f"keys must be a sequence of bytes (one per record), got {type(keys).__name__}")
    out: list[bytes] = []
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise KeyTypeError(f"keys[{i}] = {key!r} is a {type(key).__name__}, not bytes")
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidArgumentError(f"keys[{i}] has {len(key)} bytes; a key has 1..{MAX_KEY_BYTES}")
        out.append(key)
    if unique and len(set(out)) != len(out):
        seen: set[bytes] = set()
        for i, key in enumerate(out):
            if key in seen:
                raise DuplicateKeyError(f"keys[{i}] = {key!r} appears twice in one call")
            seen.add(key)
    return out


def as_rows(rows: object, count: int, limit: int, *, unique: bool) -> I64Array:
    """``count`` row ids in ``[0, limit)`` as a new int64 array (with ``unique``, no row twice)."""
    if isinstance(rows, (bytes, bytearray, str)):
        raise BlockIdTypeError(f"rows must be a sequence of ints, got {type(rows).__name__}")
    if isinstance(rows, np.ndarray):
        if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
            raise BlockIdTypeError(f"rows must be a 1-D integer array, got {rows.dtype} of shape {rows.shape}")
        out = rows.astype(np.int64, copy=True)
    elif isinstance(rows, Sequence):
        for i, row in enumerate(rows):
            if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
                raise BlockIdTypeError(f"rows[{i}] = {row!r} is not an int")
        out = np.array([int(r) for r in rows], dtype=np.int64)
    else:
        raise BlockIdTypeError(f"rows must be a sequence of ints, got {type(rows).__name__}")
    if out.shape[0] != count:
        raise InvalidBlockIdError(f"rows has {out.shape[0]} entries but keys has {count}")
    bad = np.flatnonzero((out < 0) | (out >= limit))
    if bad.size:
        i = int(bad[0])
        raise InvalidBlockIdError(f"rows[{i}] = {int(out[i])} is out of range (the host rows are {limit})")
    if unique and np.unique(out).shape[0] != count:
        _, first = np.unique(out, return_index=True)
        i = int(np.setdiff1d(np.arange(count), first)[0])
        raise InvalidBlockIdError(f"rows[{i}] = {int(out[i])} appears twice (one get writes a row once)")
    return out


def as_generations(generations: object, count: int) -> list[int | None]:
    """None, or ``count`` expected generations (each a positive int or None)."""
    if generations is None:
        return [None] * count
    if isinstance(generations, (bytes, str)) or not isinstance(generations, Sequence):
        raise ArgumentTypeError(f"generations must be None or a sequence of int | None, got {type(generations).__name__}")
    if len(generations) != count:
        raise InvalidArgumentError(f"generations has {len(generations)} entries but keys has {count}")
    out: list[int | None] = []
    for i, g in enumerate(generations):
        if g is None:
            out.append(None)
            continue
        out.append(as_int(f"generations[{i}]", g, 1, 2**64 - 1))
    return out


