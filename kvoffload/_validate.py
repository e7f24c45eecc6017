"""Argument checks shared by every job front (the worker, the handler, the disk tier): block ids and
id pairs (job ids are checked by the job book, :mod:`kvoffload._jobs`, timeouts by :mod:`kvoffload._seconds`). Each raises a typed error whose message names the argument, the value and
the rule, before anything is submitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload.errors import BlockIdTypeError, InvalidBlockIdError

__all__ = [
    "as_block_ids",
    "check_pairs",
    "check_range",
    "find_duplicate",
]

I64Array = npt.NDArray[np.int64]
#: Lists of at most this many ids are checked one by one (numpy's fixed cost is larger there).
_SHORT_IDS: Final = 16


def as_block_ids(name: str, values: object, limit: int, *, ranged: bool = True) -> I64Array:
    """Convert block ids to an ``int64`` array and check every id is in ``[0, limit)``.

    Accepts a sequence of ints or a 1-D integer numpy array / torch tensor (anything numpy converts
    to a 1-D integer array); refuses bools, floats, strings and nested sequences. The result is
    always a new array: the caller may reuse its own buffer as soon as the call returns.
    ``ranged=False`` skips the range check of a 1-D integer numpy array (an id past int64 reads as
    a negative one): for a caller that checks the range itself and names a failure with
    :func:`check_range`.

    Raises:
        BlockIdTypeError: not integers, or not one-dimensional.
        InvalidBlockIdError: a negative or out-of-range id (the message names the first one).
    """
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype.kind in "iu":
        ids = values.astype(np.int64)  # a copy, even of int64 ids
        # One reduction checks both bounds: a negative id (or a uint64 one past int64) reads as
        # a huge unsigned value. Errors are named by the general path below.
        if not ranged or ids.size == 0 or int(ids.view(np.uint64).max()) < limit:
            return ids
    if isinstance(values, (str, bytes, bytearray, memoryview)) or values is None:
        raise BlockIdTypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    if isinstance(values, np.ma.MaskedArray):
        raise BlockIdTypeError(
            f"{name} is a masked array: its mask would be ignored (pass the ids to move, e.g. "
            "values.compressed())"
        )
    if isinstance(values, (set, frozenset, Mapping)) or (
        isinstance(values, Iterable) and not isinstance(values, (Sequence, np.ndarray))
        and not hasattr(values, "__array__")
    ):
        raise BlockIdTypeError(
            f"{name} must be an ordered sequence of ints (a list, tuple, numpy array or tensor), "
            f"got a {type(values).__name__}: ids pair up by position, so their order matters"
        )
    if isinstance(values, (list, tuple)):
        if len(values) > _SHORT_IDS and all(type(v) is int for v in values):
            try:
                ids = np.array(values, dtype=np.int64)
            except OverflowError:  # an id past int64: named by the loop below
                pass
            else:
                if int(ids.view(np.uint64).max()) < limit:  # negative ids read as huge
                    return ids
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise BlockIdTypeError(
                    f"{name}[{i}] = {v!r} is a {type(v).__name__}, not an int"
                )
            if not 0 <= v < limit:  # before any cast: a huge id must be named by its own value
                raise InvalidBlockIdError(_out_of_range(name, i, int(v), limit))
        return np.array(values, dtype=np.int64)  # every id is an int in range
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: a tensor requiring grad
        raise BlockIdTypeError(f"{name} is not a sequence of ints: {exc}") from exc
    if array.ndim != 1:
        if array.ndim == 0:
            raise BlockIdTypeError(f"{name} must be a sequence of ints, got a scalar {values!r}")
        raise BlockIdTypeError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size == 0 and (array.dtype.kind in "iu" or not hasattr(values, "dtype")):
        return np.zeros(0, dtype=np.int64)  # an empty sequence without a dtype of its own is fine
    if array.dtype.kind not in "iu":
        raise BlockIdTypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.min() < 0 or array.max() >= limit:  # compared in the ids' own dtype
        i = int(np.flatnonzero((array < 0) | (array >= limit))[0])
        raise InvalidBlockIdError(_out_of_range(name, i, int(array[i]), limit))
    return np.array(array, dtype=np.int64)  # a copy: never a view of the caller's buffer


def check_range(name: str, ids: I64Array, limit: int) -> None:
    """Refuse an id of ``ids`` (an ``int64`` array of :func:`as_block_ids` with ``ranged=False``)
    outside ``[0, limit)``.

    Raises:
        InvalidBlockIdError: naming the first such id.
    """
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    if bad.size:
        i = int(bad[0])
        raise InvalidBlockIdError(_out_of_range(name, i, int(ids[i]), limit))


def _out_of_range(name: str, index: int, value: int, limit: int) -> str:
    return f"{name}[{index}] = {value} is out of range (the pool has {limit} blocks: 0..{limit - 1})"


def find_duplicate(ids: I64Array) -> int | None:
    """Index of the first id that repeats an earlier one, or None."""
    if ids.size < 2:
        return None
    ordered = np.sort(ids)
    if not bool((ordered[1:] == ordered[:-1]).any()):  # the common case, without an argsort
        return None
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    repeats = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if repeats.size == 0:
        return None
    return int(order[repeats + 1].min())


def check_pairs(src: I64Array, dst: I64Array, src_name: str, dst_name: str) -> None:
    """Refuse unequal lengths and duplicate destinations (two copies into one block race).

    Raises:
        InvalidBlockIdError: naming the lengths or the duplicated destination.
    """
    if src.shape[0] != dst.shape[0]:
        raise InvalidBlockIdError(
            f"{src_name} has {src.shape[0]} ids but {dst_name} has {dst.shape[0]}: they pair up and "
            "must have equal lengths"
        )
    dup = find_duplicate(dst)
    if dup is not None:
        raise InvalidBlockIdError(
            f"{dst_name}[{dup}] = {int(dst[dup])} repeats an earlier destination: each block may be "
            "written once per job"
        )
