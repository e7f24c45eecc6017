"""Layer map: which bytes of a block belong to which model layer (docs/design.md §12).

Owns the arithmetic from the caller's grouping (``DeviceLayout.from_tensors(..., layers=...,
layer_dim=...)``, or the default) to *pieces*: for every layer, the byte ranges of the layout's
pages it holds, as (page-table row, offset in the page, bytes). Pure numpy; the layout turns the
pieces into one page table per layer. A layer is a set of whole tensors, or one index of the
*layer dim* of tensors that hold several layers (a cross-layer cache): before the block dim it
selects whole pages, after it a slice of every page (which must start 16-byte aligned).

The grouping is checked completely: every tensor (every index of a layer dim) is in exactly one
layer, no layer is empty, names and indices exist, and bytes two tensors share (aliased tensors,
stored once) are in one layer. The default needs no argument where the layout says it: one layer
per index when every tensor has a layer dim; one layer for a single tensor; otherwise the tensors
grouped by the one number in each name (``layer3``, ``k3`` and ``v3``, ``model.layers.3.attn``),
numbered 0..L-1. Where the names do not say it, there is no default (a wrong grouping would let
attention read a layer before it landed): :func:`group_layers` returns the reason instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Final, Union

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload.errors import LayerError

__all__ = ["LayerGroups", "LayerPart", "TensorPieces", "group_layers"]

I64Array = npt.NDArray[np.int64]
#: A member of a layer: a whole tensor by name, or ``(name, index)`` along the tensor's layer dim.
LayerPart = Union[str, tuple[str, int]]
#: Every piece of a layer starts at a multiple of this on the device and in the host record.
PIECE_ALIGN_BYTES: Final = 16
_NUMBER: Final = re.compile(r"\d+")


@attrs.frozen(eq=False)
class TensorPieces:
    """What the grouping needs of one tensor of the layout.

    ``strides`` are in elements; ``rows[k]`` is the page-table row of the tensor's page at outer
    index ``k`` (C-order over the dims before the block dim; aliased pages share a row).
    """

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    item: int
    block_dim: int
    rows: I64Array


@attrs.frozen(eq=False)
class LayerGroups:
    """The layers of a layout: ``parts[i]`` names what layer ``i`` holds; ``rows[i]``,
    ``offsets[i]`` and ``sizes[i]`` are its pieces (page-table row, byte offset inside that page,
    bytes), in host-record order."""

    parts: tuple[tuple[LayerPart, ...], ...]
    rows: tuple[I64Array, ...]
    offsets: tuple[I64Array, ...]
    sizes: tuple[I64Array, ...]


def group_layers(
    tensors: Sequence[TensorPieces], host_offset: I64Array, layers: object, layer_dim: object
) -> LayerGroups | str:
    """The layers of the tensors, from ``layers`` and ``layer_dim`` (see the module docstring).

    ``host_offset`` is the page table's record offset of each row. Returns the groups, or — only
    when ``layers`` is None and the default cannot be told from the layout (the names say none,
    or say layers that share bytes) — the reason.

    Raises:
        LayerError: an explicit grouping that is malformed or breaks a rule (the message names the
            argument, the value and the rule); a ``layer_dim`` that is malformed.
    """
    by_name = {t.name: t for t in tensors}
    dims = _layer_dims(by_name, layer_dim)
    if layers is None:
        default = _default_parts(tensors, dims)
        if isinstance(default, str):
            return default
        parts = default
    else:
        parts = _explicit_parts(layers, by_name, dims)
    _check_cover(parts, by_name, dims)
    pieces = [_pieces(part_list, by_name, dims) for part_list in parts]
    try:
        rows, offsets, sizes = _check_shared_bytes(pieces, host_offset, parts)
    except LayerError as exc:
        if layers is not None or layer_dim is not None:
            raise
        # The tensors' names said the layers, and two of those layers are one memory: the names
        # do not tell the layers after all (aliased tensors belong in one layer).
        return f"the layers the tensor names say are not the layout's: {exc}"
    return LayerGroups(parts=parts, rows=rows, offsets=offsets, sizes=sizes)


def _layer_dims(by_name: dict[str, TensorPieces], layer_dim: object) -> dict[str, int]:
    if layer_dim is None:
        return {}
    if isinstance(layer_dim, Mapping):
        unknown = sorted(str(k) for k in layer_dim if k not in by_name)
        if unknown:
            raise LayerError(f"layer_dim names tensors that are not in the layout: {unknown}")
        raw: dict[str, object] = {str(k): v for k, v in layer_dim.items()}
    elif isinstance(layer_dim, int) and not isinstance(layer_dim, bool):
        raw = {name: layer_dim for name in by_name}
    else:
        raise LayerError(
            f"layer_dim = {layer_dim!r} must be an int, a mapping of tensor names to ints, or None"
        )
    dims: dict[str, int] = {}
    for name, value in raw.items():
        t = by_name[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayerError(f"layer dim of tensor {name!r} must be an int, got {value!r}")
        ndim = len(t.shape)
        if not -ndim <= value < ndim:
            raise LayerError(
                f"layer dim {value} of tensor {name!r} is out of range for its {ndim} dims "
                f"(shape {t.shape})"
            )
        dim = value % ndim
        if dim == t.block_dim:
            raise LayerError(f"layer dim {value} of tensor {name!r} is its block dim {t.block_dim}")
        dims[name] = dim
    return dims


def _default_parts(
    tensors: Sequence[TensorPieces], dims: dict[str, int]
) -> tuple[tuple[LayerPart, ...], ...] | str:
    if dims:
        missing = [t.name for t in tensors if t.name not in dims]
        if missing:
            raise LayerError(
                f"layer_dim gives a layer dim to some tensors but not to {missing}: pass layers= "
                "to say which layer those belong to"
            )
        counts = {t.name: t.shape[dims[t.name]] for t in tensors}
        if len(set(counts.values())) != 1:
            raise LayerError(
                f"the layer dims have different sizes {counts}: pass layers= to group them"
            )
        count = next(iter(counts.values()))
        return tuple(tuple((t.name, i) for t in tensors) for i in range(count))
    if len(tensors) == 1:
        return ((tensors[0].name,),)
    numbered: dict[int, list[LayerPart]] = {}
    for t in tensors:
        numbers = _NUMBER.findall(t.name)
        if len(numbers) != 1:
            return (
                f"tensor name {t.name!r} holds {len(numbers)} numbers, so its layer cannot be told "
                "from it: pass layers= (or layer_dim=) to DeviceLayout.from_tensors"
            )
        numbered.setdefault(int(numbers[0]), []).append(t.name)
    found = sorted(numbered)
    if found != list(range(len(found))):
        return (
            f"the layer numbers in the tensor names are {found[:8]}{'...' if len(found) > 8 else ''}, "
            f"not 0..{len(found) - 1}: pass layers= to DeviceLayout.from_tensors"
        )
    return tuple(tuple(numbered[i]) for i in found)


def _explicit_parts(
    layers: object, by_name: dict[str, TensorPieces], dims: dict[str, int]
) -> tuple[tuple[LayerPart, ...], ...]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise LayerError(
            f"layers must be a sequence of layers (each a sequence of tensor names or (name, index) "
            f"pairs), got {type(layers).__name__}"
        )
    if not layers:
        raise LayerError("layers is empty: a layout has at least one layer")
    result: list[tuple[LayerPart, ...]] = []
    for i, layer in enumerate(layers):
        if isinstance(layer, (str, bytes)) or not isinstance(layer, Sequence):
            raise LayerError(
                f"layers[{i}] = {layer!r} must be a sequence of tensor names or (name, index) pairs"
            )
        if not layer:
            raise LayerError(f"layers[{i}] is empty: every layer holds at least one tensor")
        result.append(tuple(_part(f"layers[{i}][{j}]", p, by_name, dims) for j, p in enumerate(layer)))
    return tuple(result)


def _part(where: str, part: object, by_name: dict[str, TensorPieces], dims: dict[str, int]) -> LayerPart:
    if isinstance(part, str):
        if part not in by_name:
            raise LayerError(f"{where} = {part!r} is not a tensor of the layout")
        if part in dims:
            raise LayerError(
                f"{where} = {part!r}: the tensor has layer dim {dims[part]}, so a layer holds one "
                f"index of it: name it as ({part!r}, index)"
            )
        return part
    if (isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], str)
            and isinstance(part[1], int) and not isinstance(part[1], bool)):
        name, index = part
        if name not in by_name:
            raise LayerError(f"{where} = {part!r} names {name!r}, which is not a tensor of the layout")
        if name not in dims:
            raise LayerError(
                f"{where} = {part!r}: tensor {name!r} has no layer dim (pass layer_dim= to say "
                "which dim holds its layers)"
            )
        size = by_name[name].shape[dims[name]]
        if not 0 <= index < size:
            raise LayerError(
                f"{where} = {part!r}: index {index} is out of range for layer dim {dims[name]} of "
                f"tensor {name!r} (size {size})"
            )
        return (name, index)
    raise LayerError(f"{where} = {part!r} must be a tensor name or a (name, index) pair")


def _check_cover(
    parts: tuple[tuple[LayerPart, ...], ...], by_name: dict[str, TensorPieces], dims: dict[str, int]
) -> None:
    """Every tensor (every index of a layer dim) in exactly one layer."""
    owner: dict[LayerPart, int] = {}
    for i, layer in enumerate(parts):
        for part in layer:
            if part in owner:
                where = f"twice in layer {i}" if owner[part] == i else f"in layer {owner[part]} and in layer {i}"
                raise LayerError(f"{_describe(part)} is {where}: a tensor belongs to one layer, once")
            owner[part] = i
    uncovered: list[str] = []
    for name, t in by_name.items():
        if name in dims:
            uncovered += [_describe((name, k)) for k in range(t.shape[dims[name]]) if (name, k) not in owner]
        elif name not in owner:
            uncovered.append(_describe(name))
    if uncovered:
        more = f" and {len(uncovered) - 4} more" if len(uncovered) > 4 else ""
        raise LayerError(
            f"layers do not cover {', '.join(uncovered[:4])}{more}: every tensor must be in a layer"
        )


def _describe(part: LayerPart) -> str:
    return f"tensor {part!r}" if isinstance(part, str) else f"index {part[1]} of tensor {part[0]!r}"


def _pieces(
    parts: tuple[LayerPart, ...], by_name: dict[str, TensorPieces], dims: dict[str, int]
) -> tuple[I64Array, I64Array, I64Array]:
    """(rows, offsets, sizes) of one layer's parts, unsorted."""
    rows: list[I64Array] = []
    offsets: list[I64Array] = []
    sizes: list[I64Array] = []
    for part in parts:
        name, index = (part, -1) if isinstance(part, str) else part
        t = by_name[name]
        b = t.block_dim
        page_bytes = math.prod(t.shape[b + 1 :]) * t.item
        if index < 0:
            rows.append(t.rows)
            offsets.append(np.zeros(t.rows.shape[0], dtype=np.int64))
            sizes.append(np.full(t.rows.shape[0], page_bytes, dtype=np.int64))
            continue
        d = dims[name]
        if d < b:  # the layer dim is an outer dim: whole pages
            coords = np.indices(t.shape[:b], dtype=np.int64).reshape(b, -1)
            picked = t.rows[coords[d] == index]
            rows.append(picked)
            offsets.append(np.zeros(picked.shape[0], dtype=np.int64))
            sizes.append(np.full(picked.shape[0], page_bytes, dtype=np.int64))
            continue
        # The layer dim is inside the page: the slices of every page at that index.
        split = t.shape[b + 1 : d + 1]
        coords = np.indices(split, dtype=np.int64).reshape(len(split), -1)
        coords = coords[:, coords[-1] == index]
        strides = np.asarray(t.strides[b + 1 : d + 1], dtype=np.int64) * t.item
        within = (coords * strides[:, None]).sum(axis=0)
        piece = math.prod(t.shape[d + 1 :]) * t.item
        misaligned = within[within % PIECE_ALIGN_BYTES != 0]
        if misaligned.size:
            raise LayerError(
                f"index {index} of layer dim {d} of tensor {name!r} starts {int(misaligned[0])} bytes "
                f"into a page, not a multiple of {PIECE_ALIGN_BYTES}: a layer's slice of a page must "
                "be 16-byte aligned"
            )
        rows.append(np.repeat(t.rows, within.shape[0]))
        offsets.append(np.tile(within, t.rows.shape[0]))
        sizes.append(np.full(t.rows.shape[0] * within.shape[0], piece, dtype=np.int64))
    return np.concatenate(rows), np.concatenate(offsets), np.concatenate(sizes)


def _check_shared_bytes(
    pieces: list[tuple[I64Array, I64Array, I64Array]],
    host_offset: I64Array,
    parts: tuple[tuple[LayerPart, ...], ...],
) -> tuple[tuple[I64Array, ...], tuple[I64Array, ...], tuple[I64Array, ...]]:
    """Drop pieces listed twice in one layer (aliased tensors); refuse bytes in two layers and
    pieces that partly overlap. Returns each layer's pieces in host-record order."""
    layer = np.concatenate([np.full(p[0].shape[0], i, dtype=np.int64) for i, p in enumerate(pieces)])
    rows = np.concatenate([p[0] for p in pieces])
    offsets = np.concatenate([p[1] for p in pieces])
    sizes = np.concatenate([p[2] for p in pieces])
    starts = host_offset[rows] + offsets
    order = np.lexsort((layer, sizes, starts))
    layer, rows, offsets, sizes, starts = (a[order] for a in (layer, rows, offsets, sizes, starts))
    same = (starts[1:] == starts[:-1]) & (sizes[1:] == sizes[:-1])
    crossed = np.flatnonzero(same & (layer[1:] != layer[:-1]))
    if crossed.size:
        j = int(crossed[0])
        raise LayerError(
            f"layers {int(layer[j])} and {int(layer[j + 1])} share the same bytes (tensors that are "
            f"views of one memory): {_names(parts[int(layer[j])])} and "
            f"{_names(parts[int(layer[j + 1])])}; aliased tensors must be in one layer"
        )
    keep = np.concatenate((np.ones(1, dtype=bool), ~same))
    layer, rows, offsets, sizes, starts = (a[keep] for a in (layer, rows, offsets, sizes, starts))
    overlap = np.flatnonzero(starts[1:] < starts[:-1] + sizes[:-1])
    if overlap.size:
        j = int(overlap[0])
        raise LayerError(
            f"layers {int(layer[j])} and {int(layer[j + 1])} hold bytes that partly overlap at record "
            f"offset {int(starts[j + 1])}: aliased tensors must be split into layers the same way"
        )
    result_rows, result_offsets, result_sizes = [], [], []
    for i in range(len(pieces)):
        mine = layer == i
        result_rows.append(rows[mine])
        result_offsets.append(offsets[mine])
        result_sizes.append(sizes[mine])
    return tuple(result_rows), tuple(result_offsets), tuple(result_sizes)


def _names(parts: tuple[LayerPart, ...]) -> str:
    return ", ".join(_describe(p) for p in parts[:3]) + (" ..." if len(parts) > 3 else "")
