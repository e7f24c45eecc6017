"""Layout: the engine's device tensors as page geometry and a host record map.

Owns the description of where every byte of a block lives, on the device and inside a host record.
Borrows the engine's tensors (holds references so their addresses stay valid; never writes them).
Works on CPU tensors exactly as on CUDA tensors, so it is tested without a GPU.

A tensor's *block dim* is given explicitly: shape heuristics are how peers silently corrupted data
when an engine changed its KV layout. For a tensor of shape ``(*outer, num_blocks, *inner)`` with
block dim ``b``, a *page* is the contiguous ``inner`` bytes of one block at one outer index; the
block's pages from every tensor, in tensor order then outer C-order, laid back to back (each start
aligned to 16 bytes) form its *host record*, whose size is padded to a multiple of 4096 bytes.
Pages that are the same device bytes (a tensor given twice, or two views of one memory) are stored
once; pages that partly overlap are refused.

The layout also says which bytes make each model *layer* (docs/design.md §12): one page table per
layer, for loads whose layers land one after the other. Layers group bytes, never move them: the
host record and the fingerprint are the same with any grouping.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvoffload._descriptors import PageTable
from kvoffload._layer_map import LayerGroups, LayerPart, TensorPieces, group_layers
from kvoffload._validate import as_block_ids, find_duplicate
from kvoffload.errors import (
    ArgumentTypeError, BlockIdTypeError, InvalidArgumentError, InvalidBlockIdError, LayerError,
    LayoutError,
)

__all__ = ["PAGE_ALIGN_BYTES", "RECORD_ALIGN_BYTES", "DeviceLayout", "TensorGeometry"]

#: Every page starts at a multiple of this, on the device (checked) and in the host record (padded).
PAGE_ALIGN_BYTES: Final = 16
#: Host records are padded to a multiple of this (one OS page), for O_DIRECT and page-granular use.
RECORD_ALIGN_BYTES: Final = 4096
#: Interleaved tensors are checked page by page; beyond this many pages the check is refused.
_MAX_INTERLEAVE_CHECK_PAGES: Final = 1 << 26

I64Array = npt.NDArray[np.int64]
#: Block ids as the layout's torch helpers accept them.
BlockIndex = Sequence[int] | npt.NDArray[np.integer] | torch.Tensor


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@attrs.frozen
class TensorGeometry:
    """Where one tensor's pages are.

    Attributes:
        name: the tensor's name in the layout.
        shape: its shape.
        dtype: its dtype, as a string (``"torch.bfloat16"``).
        block_dim: the non-negative block dim.
        page_bytes: bytes of one page (the ``inner`` dims after the block dim).
        block_stride_bytes: distance between the same page of consecutive blocks.
        outer_count: pages per block from this tensor (the product of the dims before the block dim).
        host_offsets: offset of each of its pages inside a host record (shared with an earlier tensor
            when the pages alias it).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    block_dim: int
    page_bytes: int
    block_stride_bytes: int
    outer_count: int
    host_offsets: tuple[int, ...]


@attrs.frozen(eq=False)
class _TensorPages:
    name: str
    tensor: torch.Tensor
    block_dim: int
    page_bytes: int
    stride: int
    addr0: I64Array  # block-0 address of each page, outer C-order
    segment: int


@attrs.frozen(eq=False)
class DeviceLayout:
    """The engine's paged KV tensors described as blocks of pages (see the module docstring).

    Build it with :meth:`from_tensors`. Attributes are read-only; ``page_table`` is what the copy
    planner consumes.
    """

    tensors: Mapping[str, torch.Tensor]
    geometries: tuple[TensorGeometry, ...]
    device: torch.device
    num_blocks: int
    record_bytes: int
    page_table: PageTable
    fingerprint: str
    model_id: str = ""
    layers: tuple[tuple[LayerPart, ...], ...] | None = None
    layer_tables: tuple[PageTable, ...] = ()
    layers_missing: str = ""

    def __repr__(self) -> str:
        """One line: tensors, device, blocks, pages and record size, fingerprint prefix."""
        return (
            f"DeviceLayout({len(self.geometries)} tensors on {self.device}, {self.num_blocks} blocks, "
            f"{self.pages_per_block} pages ({self.block_bytes} bytes) per block, record "
            f"{self.record_bytes} bytes, model_id={self.model_id!r}, "
            f"fingerprint {self.fingerprint[:12]}...)"
        )

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        block_dim: int | Mapping[str, int],
        *,
        num_blocks: int | None = None,
        model_id: str = "",
        layers: Sequence[Sequence[LayerPart]] | None = None,
        layer_dim: int | Mapping[str, int] | None = None,
    ) -> DeviceLayout:
        """Describe the engine's tensors, each with an explicit block dim.

        Args:
            tensors: the device cache tensors, by name (a sequence is named ``"0"``, ``"1"``, ...).
            block_dim: the block dim of every tensor, or a mapping giving each tensor's own block dim
                (negative values count from the end, as in torch).
            num_blocks: the number of blocks the engine allocated; when given, every tensor's block
                dim must have exactly this size (it catches a wrong ``block_dim``, which would
                otherwise describe, say, the K/V dim of size 2 as the blocks).
            model_id: the caller's name for the model whose KV these tensors hold (for example its
                name and revision). It is part of :attr:`fingerprint`, so records written for one
                model are never read for another of the same shapes.
            layers: which tensors make each model layer, layer 0 first (for
                ``Worker.load_by_layer``): each layer a sequence of tensor names, or of
                ``(name, index)`` pairs naming one index of a tensor's layer dim. Every tensor (every
                index) must be in exactly one layer. Default (None): one layer per index when every
                tensor has a ``layer_dim``; one layer for a single tensor; otherwise the tensors
                grouped by the one number in each name (``layer3``; ``k3`` with ``v3``), which must
                run 0..L-1 — when the names do not say it the layout has no layers
                (``layers_missing`` says why) and ``load_by_layer`` refuses it.
            layer_dim: the dim that indexes layers in a tensor holding several (a cross-layer
                cache ``[N, L, ...]`` has ``layer_dim=1``): an int for every tensor, or a mapping
                by name. After the block dim it selects a slice of every page, which must start at a
                multiple of 16 bytes.

        Raises:
            LayoutError: naming the tensor and the rule: no tensors, not a tensor, mixed devices,
                a block dim out of range or missing, zero blocks, different block counts, a block
                count other than ``num_blocks``, a page that is not contiguous, a page or block
                stride not 16-byte aligned, pages that overlap (within a tensor or across tensors)
                without being the same bytes.
            LayerError: ``layers`` or ``layer_dim`` malformed or breaking a rule: a tensor (or an
                index) in two layers or in none, an empty layer, an unknown name or index, aliased
                tensors in two layers, a slice that is not 16-byte aligned (a :class:`LayoutError`).
            ArgumentTypeError: ``num_blocks`` not an int or ``model_id`` not a str.
        """
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)):
            raise ArgumentTypeError(
                f"num_blocks = {num_blocks!r} must be an int or None, not a {type(num_blocks).__name__}"
            )
        if num_blocks is not None and num_blocks < 1:
            raise LayoutError(f"num_blocks = {num_blocks} must be >= 1 (the blocks the engine allocated)")
        if not isinstance(model_id, str):
            raise ArgumentTypeError(f"model_id = {model_id!r} must be a str, not a {type(model_id).__name__}")
        named = _named_tensors(tensors)
        dims = _block_dims(named, block_dim)
        device = _common_device(named)
        num_blocks = _common_block_count(named, dims, num_blocks)
        segments: dict[int, int] = {}
        pages = [
            _tensor_pages(name, t, dims[name], segments.setdefault(_storage_key(t), len(segments)))
            for name, t in named.items()
        ]
        _check_no_partial_overlap(pages, num_blocks)
        return cls._assemble(named, pages, device, num_blocks, model_id, layers, layer_dim)

    @classmethod
    def _assemble(
        cls,
        named: dict[str, torch.Tensor],
        pages: list[_TensorPages],
        device: torch.device,
        num_blocks: int,
        model_id: str,
        layers: object = None,
        layer_dim: object = None,
    ) -> DeviceLayout:
        seen: dict[tuple[int, int, int], tuple[int, int]] = {}  # page -> (record offset, row)
        rows_of: list[TensorPieces] = []
        dev_base: list[int] = []
        dev_stride: list[int] = []
        nbytes: list[int] = []
        host_offset: list[int] = []
        segment: list[int] = []
        geometries: list[TensorGeometry] = []
        cursor = 0
        for tp in pages:
            offsets: list[int] = []
            rows: list[int] = []
            for addr in tp.addr0.tolist():
                key = (addr, tp.stride, tp.page_bytes)
                if key in seen:
                    offsets.append(seen[key][0])
                    rows.append(seen[key][1])
                    continue
                cursor = _align_up(cursor, PAGE_ALIGN_BYTES)
                seen[key] = (cursor, len(nbytes))
                offsets.append(cursor)
                rows.append(len(nbytes))
                dev_base.append(addr)
                dev_stride.append(tp.stride)
                nbytes.append(tp.page_bytes)
                host_offset.append(cursor)
                segment.append(tp.segment)
                cursor += tp.page_bytes
            t = tp.tensor
            rows_of.append(TensorPieces(
                name=tp.name, shape=tuple(int(x) for x in t.shape),
                strides=tuple(int(x) for x in t.stride()), item=t.element_size(),
                block_dim=tp.block_dim, rows=np.asarray(rows, dtype=np.int64),
            ))
            geometries.append(
                TensorGeometry(
                    name=tp.name,
                    shape=tuple(t.shape),
                    dtype=str(t.dtype),
                    block_dim=tp.block_dim,
                    page_bytes=tp.page_bytes,
                    block_stride_bytes=tp.stride,
                    outer_count=len(offsets),
                    host_offsets=tuple(offsets),
                )
            )
        record_bytes = _align_up(max(cursor, 1), RECORD_ALIGN_BYTES)
        table = PageTable(
            dev_base=np.asarray(dev_base, dtype=np.int64),
            dev_stride=np.asarray(dev_stride, dtype=np.int64),
            nbytes=np.asarray(nbytes, dtype=np.int64),
            host_offset=np.asarray(host_offset, dtype=np.int64),
            segment=np.asarray(segment, dtype=np.int64),
            record_bytes=record_bytes,
        )
        groups = group_layers(rows_of, table.host_offset, layers, layer_dim)
        return cls(
            tensors=dict(named),
            geometries=tuple(geometries),
            device=device,
            num_blocks=num_blocks,
            record_bytes=record_bytes,
            page_table=table,
            fingerprint=_fingerprint(geometries, record_bytes, model_id),
            model_id=model_id,
            layers=None if isinstance(groups, str) else groups.parts,
            layer_tables=() if isinstance(groups, str) else _layer_tables(table, groups),
            layers_missing=groups if isinstance(groups, str) else "",
        )

    @property
    def num_layers(self) -> int | None:
        """Layers of the layout (None when the tensor names do not say them; see ``layers``)."""
        return len(self.layer_tables) if self.layers is not None else None

    def require_layers(self) -> tuple[PageTable, ...]:
        """The per-layer page tables (``layer_tables``).

        Raises:
            LayerError: the layout has no layers (the message says why and what to pass).
        """
        if self.layers is None:
            raise LayerError(f"the layout has no layers: {self.layers_missing}")
        return self.layer_tables

    @property
    def pages_per_block(self) -> int:
        """Distinct pages in one block (aliased pages counted once)."""
        return self.page_table.num_pages

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block, without the record's padding."""
        return self.page_table.block_bytes

    def gather_records(self, blocks: BlockIndex) -> torch.Tensor:
        """Build the host records of the given device blocks with torch indexing.

        A second, independent implementation of the record map (it uses neither copy descriptors
        nor addresses); tests and the demo check the copy paths against it. Runs on the layout's
        device; padding bytes are zero. Returns ``uint8 [len(blocks), record_bytes]``.

        Raises:
            BlockIdTypeError, InvalidBlockIdError: ``blocks`` not integers, or out of range (ids
                given as a GPU tensor: their dtype and shape only, so that the gather stays queued).
        """
        index = self._block_index(blocks)
        out = torch.zeros(
            (index.shape[0], self.record_bytes), dtype=torch.uint8, device=self.device
        )
        for geom, rows in self._tensor_rows(index):
            for outer, offset in enumerate(geom.host_offsets):
                out[:, offset : offset + geom.page_bytes] = rows[:, outer]
        return out

    def scatter_records(self, blocks: BlockIndex, records: torch.Tensor) -> None:
        """Write host records into the given device blocks with torch indexing (the inverse of
        :meth:`gather_records`; for tests and the demo). ``records`` is ``uint8 [n, record_bytes]``.

        Raises:
            BlockIdTypeError, InvalidBlockIdError: ``blocks`` not integers, out of range, or a
                block twice (which record it would hold is undefined).
            ArgumentTypeError: ``records`` is not a ``uint8`` tensor.
            InvalidArgumentError: ``records`` is not ``[len(blocks), record_bytes]``.
        """
        index = self._block_index(blocks, distinct=True)
        if not isinstance(records, torch.Tensor) or records.dtype != torch.uint8:
            kind = f"a {records.dtype} tensor" if isinstance(records, torch.Tensor) else type(records).__name__
            raise ArgumentTypeError(f"records must be a uint8 tensor, got {kind}")
        if tuple(records.shape) != (index.shape[0], self.record_bytes):
            raise InvalidArgumentError(
                f"records has shape {tuple(records.shape)}; it must be [{index.shape[0]}, "
                f"{self.record_bytes}] (one record of {self.record_bytes} bytes per block)"
            )
        src = records.to(self.device)
        for geom in self.geometries:
            moved = _byte_view(self.tensors[geom.name]).movedim(geom.block_dim, 0)
            rows = torch.stack([src[:, o : o + geom.page_bytes] for o in geom.host_offsets], dim=1)
            moved.index_copy_(0, index, rows.reshape(index.shape[0], *moved.shape[1:]))

    def _block_index(self, blocks: BlockIndex, *, distinct: bool = False) -> torch.Tensor:
        """``blocks`` checked (as a job's ids are) and on the layout's device as ``long``.

        Ids given as a tensor on a GPU are checked for their dtype and shape only: a range or
        duplicate check would read them back and so wait for the work queued before them, and a
        gather queued on a compute stream (as the ordering tests queue one behind a stall) must
        stay queued.

        Raises:
            BlockIdTypeError, InvalidBlockIdError: as :func:`~kvoffload._validate.as_block_ids`; a
                block twice where ``distinct``.
        """
        if isinstance(blocks, torch.Tensor) and blocks.device.type != "cpu":
            if blocks.dtype.is_floating_point or blocks.dtype.is_complex or blocks.dtype == torch.bool:
                raise BlockIdTypeError(f"blocks must hold integers, got dtype {blocks.dtype}")
            if blocks.ndim != 1:
                raise BlockIdTypeError(f"blocks must be one-dimensional, got shape {tuple(blocks.shape)}")
            return blocks.to(device=self.device, dtype=torch.long, non_blocking=True)
        ids = as_block_ids("blocks", blocks, self.num_blocks)
        if distinct:
            twice = find_duplicate(ids)
            if twice is not None:
                raise InvalidBlockIdError(f"blocks[{twice}] = {ids[twice]} repeats an earlier block")
        return torch.from_numpy(ids).to(self.device)

    def _tensor_rows(self, index: torch.Tensor) -> list[tuple[TensorGeometry, torch.Tensor]]:
        result = []
        for geom in self.geometries:
            t = _byte_view(self.tensors[geom.name])
            picked = t.index_select(geom.block_dim, index).movedim(geom.block_dim, 0).contiguous()
            rows = picked.reshape(index.shape[0], geom.outer_count, geom.page_bytes)
            result.append((geom, rows))
        return result


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements as a ``uint8`` tensor of shape ``t.shape + (item,)``, read
    from its storage as the copy paths read them: no conjugation, no bool normalisation, and
    dtypes torch cannot index (int4, uint1) included."""
    item = t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(),
        t.storage_offset() * item,
        (*t.shape, item),
        (*(s * item for s in t.stride()), 1),
    )


def _layer_tables(table: PageTable, groups: LayerGroups) -> tuple[PageTable, ...]:
    """One page table per layer: its pieces of the layout's pages, with the same record size."""
    result = []
    for rows, offsets, sizes in zip(groups.rows, groups.offsets, groups.sizes):
        result.append(PageTable(
            dev_base=table.dev_base[rows] + offsets,
            dev_stride=table.dev_stride[rows],
            nbytes=sizes,
            host_offset=table.host_offset[rows] + offsets,
            segment=table.segment[rows],
            record_bytes=table.record_bytes,
        ))
    return tuple(result)


def _named_tensors(
    tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
) -> dict[str, torch.Tensor]:
    given: object = tensors  # checked at run time: callers are not always type-checked
    if isinstance(given, torch.Tensor):
        raise LayoutError("tensors must be a mapping or a sequence of tensors, not one tensor")
    if isinstance(given, Mapping):
        named = dict(given)
    elif isinstance(given, Sequence):
        named = {str(i): t for i, t in enumerate(given)}
    else:
        raise LayoutError(f"tensors must be a mapping or a sequence of tensors, not {type(given).__name__}")
    if not named:
        raise LayoutError("tensors is empty: a layout needs at least one tensor")
    for name, t in named.items():
        if not isinstance(name, str):
            raise LayoutError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout is not torch.strided or t.is_nested or t.is_quantized:
            kind = "nested" if t.is_nested else "quantized" if t.is_quantized else str(t.layout)
            raise LayoutError(f"tensor {name!r} is a {kind} tensor: a layout needs dense strided tensors "
                              "whose pages are plain memory")
        try:
            t.untyped_storage().data_ptr()
        except RuntimeError as exc:  # e.g. a zero tensor, which has no memory
            raise LayoutError(f"tensor {name!r} has no storage of its own: {exc}") from None
    return named


def _block_dims(named: dict[str, torch.Tensor], block_dim: int | Mapping[str, int]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for name, t in named.items():
        if isinstance(block_dim, Mapping):
            if name not in block_dim:
                raise LayoutError(f"tensor {name!r} has no entry in the block_dim mapping")
            raw = block_dim[name]
        else:
            raw = block_dim
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise LayoutError(f"block dim of tensor {name!r} must be an int, got {raw!r}")
        ndim = t.dim()
        if not -ndim <= raw < ndim:
            raise LayoutError(
                f"block dim {raw} of tensor {name!r} is out of range for its {ndim} dims "
                f"(shape {tuple(t.shape)})"
            )
        dims[name] = raw % ndim
    if isinstance(block_dim, Mapping):
        extra = sorted(set(block_dim) - set(named))
        if extra:
            raise LayoutError(f"block_dim names tensors that are not in the layout: {extra}")
    return dims


def _common_device(named: dict[str, torch.Tensor]) -> torch.device:
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.device != first.device:
            raise LayoutError(
                f"tensor {name!r} is on {t.device} but tensor {first_name!r} is on {first.device}: "
                "all tensors of a layout must be on one device"
            )
    return first.device


def _common_block_count(
    named: dict[str, torch.Tensor], dims: dict[str, int], expected: int | None
) -> int:
    first_name = next(iter(named))
    count = named[first_name].shape[dims[first_name]]
    for name, t in named.items():
        n = t.shape[dims[name]]
        if n == 0:
            raise LayoutError(f"tensor {name!r} has zero blocks (shape {tuple(t.shape)})")
        if expected is not None and n != expected:
            raise LayoutError(
                f"tensor {name!r} has {n} blocks along block dim {dims[name]} (shape "
                f"{tuple(t.shape)}) but num_blocks = {expected}: is block_dim right?"
            )
        if n != count:
            raise LayoutError(
                f"tensor {name!r} has {n} blocks but tensor {first_name!r} has {count}: "
                "all tensors must have the same number of blocks"
            )
    return int(count)


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _tensor_pages(name: str, t: torch.Tensor, b: int, segment: int) -> _TensorPages:
    shape = tuple(int(s) for s in t.shape)
    item = t.element_size()
    strides = tuple(int(s) for s in t.stride())
    inner = shape[b + 1 :]
    if any(s == 0 for s in shape):
        raise LayoutError(f"tensor {name!r} has an empty dim (shape {shape}): pages would be empty")
    expected = 1
    for size, stride in zip(reversed(inner), reversed(strides[b + 1 :])):
        if size != 1 and stride != expected:
            raise LayoutError(
                f"tensor {name!r}: a page (the dims after block dim {b}, shape {inner}) is not "
                f"contiguous (strides {strides[b + 1:]}); pass a tensor whose dims after the block "
                "dim are contiguous"
            )
        expected *= size
    page_bytes = math.prod(inner) * item
    # With one block the block dim's stride is arbitrary; 0 keeps equal pages equal for the dedupe.
    block_stride = strides[b] * item if shape[b] > 1 else 0
    outer_shape = shape[:b]
    outer_strides = np.asarray(strides[:b], dtype=np.int64) * item
    if outer_shape:
        grids = np.indices(outer_shape, dtype=np.int64).reshape(len(outer_shape), -1)
        outer_offsets = (grids * outer_strides[:, None]).sum(axis=0)
    else:
        outer_offsets = np.zeros(1, dtype=np.int64)
    addr0 = np.int64(t.data_ptr()) + outer_offsets
    misaligned = np.flatnonzero(addr0 % PAGE_ALIGN_BYTES)
    if misaligned.size:
        raise LayoutError(
            f"tensor {name!r}: page {int(misaligned[0])} of block 0 starts at address "
            f"{int(addr0[misaligned[0]]):#x}, not {PAGE_ALIGN_BYTES}-byte aligned"
        )
    if shape[b] > 1 and block_stride % PAGE_ALIGN_BYTES:
        raise LayoutError(
            f"tensor {name!r}: block stride {block_stride} bytes is not a multiple of "
            f"{PAGE_ALIGN_BYTES}, so pages of later blocks are misaligned"
        )
    _check_self_disjoint(name, shape, strides, b, item, page_bytes)
    storage = t.untyped_storage()
    first, span = int(t.data_ptr()), sum((n - 1) * st for n, st in zip(shape, strides)) * item + item
    if first < storage.data_ptr() or first + span > storage.data_ptr() + storage.nbytes():
        raise LayoutError(
            f"tensor {name!r} spans {span} bytes from offset {first - storage.data_ptr()} of a storage "
            f"of {storage.nbytes()} bytes (a storage resized under it): its pages are not its memory"
        )
    return _TensorPages(name, t, b, page_bytes, block_stride, addr0.astype(np.int64), segment)


def _check_self_disjoint(
    name: str, shape: tuple[int, ...], strides: tuple[int, ...], b: int, item: int, page_bytes: int
) -> None:
    """Refuse tensors whose pages could overlap each other (zero or interleaved strides).

    Sufficient test: sorted by stride, every page-level dim must step past everything the smaller
    dims already span.
    """
    dims = sorted((strides[i] * item, shape[i]) for i in range(b + 1) if shape[i] > 1)
    extent = page_bytes
    for stride, size in dims:
        if stride < extent:
            raise LayoutError(
                f"tensor {name!r}: its pages overlap (a stride of {stride} bytes is smaller than the "
                f"{extent} bytes the page and smaller dims span; shape {shape}, strides {strides})"
            )
        extent = stride * (size - 1) + extent


def _span(tp: _TensorPages, num_blocks: int) -> tuple[int, int]:
    lo = int(tp.addr0.min())
    hi = int(tp.addr0.max()) + (num_blocks - 1) * tp.stride + tp.page_bytes
    return lo, hi


def _check_no_partial_overlap(pages: list[_TensorPages], num_blocks: int) -> None:
    """Refuse tensors whose pages overlap pages of another tensor without being the same pages.

    Tensors whose address spans overlap form groups (one sweep over the spans sorted by start);
    each group's pages are checked in one sort, so many views of one storage cost ``n log n``, not
    a check per pair of them.
    """
    spans = [_span(tp, num_blocks) for tp in pages]
    order = sorted(range(len(pages)), key=lambda i: spans[i][0])
    group: list[int] = []
    reach = 0
    for i in order:
        lo, hi = spans[i]
        if group and lo >= reach:
            _check_group(group, pages, num_blocks)
            group = []
        group.append(i)
        reach = hi if len(group) == 1 else max(reach, hi)
    _check_group(group, pages, num_blocks)


def _check_group(group: list[int], pages: list[_TensorPages], num_blocks: int) -> None:
    """One group of tensors with overlapping spans, in layout order: the same pages, or disjoint."""
    members: dict[tuple[int, int, frozenset[int]], _TensorPages] = {}
    for i in sorted(group):
        tp = pages[i]
        members.setdefault((tp.stride, tp.page_bytes, frozenset(tp.addr0.tolist())), tp)
    if len(members) < 2 or _disjoint_modulo_stride(list(members.values()), num_blocks):
        return
    _check_page_by_page(list(members.values()), num_blocks)


#: Distinct pages that meet modulo the stride, in one cluster, that the quick check compares pair by
#: pair; a larger cluster goes to the page-by-page check.
_MAX_CLUSTER_PAGES: Final = 64


def _disjoint_modulo_stride(members: list[_TensorPages], num_blocks: int) -> bool:
    """Whether tensors whose blocks all step by one stride ``S`` have pages that are the same page
    or never meet in the blocks there are, decided from one block's pages whatever the number of
    blocks: pages disjoint modulo ``S`` are disjoint at every block, and the few that meet modulo
    ``S`` (say K and V halves of one view, ``num_blocks * S`` apart) are compared exactly
    (:func:`_pages_meet`). ``False`` says only that the page-by-page check is to decide."""
    stride = members[0].stride
    if num_blocks < 2 or stride <= 0 or any(m.stride != stride or m.page_bytes > stride for m in members):
        return False
    addr = np.concatenate([m.addr0 for m in members])
    size = np.concatenate([np.full(m.addr0.shape, m.page_bytes, dtype=np.int64) for m in members])
    rem = addr % stride
    wraps = rem + size > stride  # such a page is two pieces on the circle: [rem, S) and [0, rest)
    starts = np.concatenate((rem, np.zeros(int(wraps.sum()), dtype=np.int64)))
    ends = np.concatenate((np.minimum(rem + size, stride), (rem + size - stride)[wraps]))
    addr = np.concatenate((addr, addr[wraps]))
    size = np.concatenate((size, size[wraps]))
    order = np.argsort(starts, kind="stable")
    starts, ends, addr, size = starts[order], ends[order], addr[order], size[order]
    reach = np.maximum.accumulate(ends)
    first = np.flatnonzero(np.concatenate(([True], starts[1:] >= reach[:-1])))  # where clusters start
    bounds = np.append(first, starts.size)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if hi - lo < 2:
            continue
        pages = sorted(set(zip(addr[lo:hi].tolist(), size[lo:hi].tolist())))  # the same page once
        if len({(a % stride, n) for a, n in pages}) == 1:  # one residue and size: pages a multiple of
            starts_here = [a for a, _ in pages]  # S apart meet exactly when closer than nb * S
            if all(b - a >= num_blocks * stride for a, b in zip(starts_here, starts_here[1:])):
                continue
            return False
        if len(pages) > _MAX_CLUSTER_PAGES:
            return False
        for i, (a_p, n_p) in enumerate(pages):
            for a_q, n_q in pages[i + 1:]:
                if _pages_meet(a_p, n_p, a_q, n_q, stride, num_blocks):
                    return False
    return True


def _pages_meet(a_p: int, n_p: int, a_q: int, n_q: int, stride: int, num_blocks: int) -> bool:
    """Whether page ``p`` of some block and page ``q`` of some block overlap, both stepping by
    ``stride`` over ``num_blocks`` blocks: block ``i`` of ``p`` and ``j`` of ``q`` overlap when
    ``d - n_p < (i - j) * stride < d + n_q`` (``d = a_q - a_p``)."""
    d = a_q - a_p
    low = (d - n_p) // stride + 1  # the least k with k * stride > d - n_p
    high = -(-(d + n_q) // stride) - 1  # the greatest k with k * stride < d + n_q
    return max(low, 1 - num_blocks) <= min(high, num_blocks - 1)


def _check_page_by_page(members: list[_TensorPages], num_blocks: int) -> None:
    """Every page of every block of ``members`` (distinct tensors), sorted: the same page, or
    disjoint. A group too large for one sort is checked pair by pair (the bound is a pair's)."""
    if len(members) > 2 and sum(m.addr0.size for m in members) * num_blocks > _MAX_INTERLEAVE_CHECK_PAGES:
        spans = [_span(m, num_blocks) for m in members]
        for i in range(len(members)):
            for j in range(i + 1, len(members)):
                (lo_i, hi_i), (lo_j, hi_j) = spans[i], spans[j]
                pair = [members[i], members[j]]
                if lo_i < hi_j and lo_j < hi_i and not _disjoint_modulo_stride(pair, num_blocks):
                    _check_page_by_page(pair, num_blocks)
        return
    if sum(m.addr0.size for m in members) * num_blocks > _MAX_INTERLEAVE_CHECK_PAGES:
        names = ", ".join(repr(m.name) for m in members[:4]) + (", ..." if len(members) > 4 else "")
        raise LayoutError(
            f"tensors {names} share an address range and are too large to verify page by page; "
            "pass them as one tensor"
        )
    parts = [_page_intervals(m, num_blocks) for m in members]
    starts = np.concatenate([p[0] for p in parts])
    sizes = np.concatenate([p[1] for p in parts])
    blocks = np.concatenate([p[2] for p in parts])
    owner = np.concatenate([np.full(p[0].shape, k, dtype=np.int64) for k, p in enumerate(parts)])
    strides = np.array([m.stride for m in members], dtype=np.int64)[owner]
    order = np.argsort(starts, kind="stable")
    starts, sizes, blocks, owner, strides = (
        starts[order], sizes[order], blocks[order], owner[order], strides[order]
    )
    # Sorted by start, any overlap shows between neighbours. The same page of the same block in
    # two tensors is fine (stored once) where their blocks step alike; any other overlap, including
    # the same bytes under two block ids, or one page shared at some blocks only (block strides
    # that differ: the page would be stored twice and loaded from two records, the last one
    # winning), is not.
    overlap = starts[:-1] + sizes[:-1] > starts[1:]
    identical = (
        (starts[:-1] == starts[1:]) & (sizes[:-1] == sizes[1:]) & (blocks[:-1] == blocks[1:])
        & (strides[:-1] == strides[1:])
    )
    bad = np.flatnonzero(overlap & ~identical)
    if bad.size:
        k = int(bad[0])
        a, b = sorted((int(owner[k]), int(owner[k + 1])))
        at = int(starts[k + 1])
        raise LayoutError(
            f"tensors {members[a].name!r} and {members[b].name!r} partly overlap at address "
            f"{at:#x}: pages must be either the same bytes (stored once) or disjoint"
        )


def _page_intervals(tp: _TensorPages, num_blocks: int) -> tuple[I64Array, I64Array, I64Array]:
    """Start, size and block index of every page of every block."""
    block = np.arange(num_blocks, dtype=np.int64)
    starts = (tp.addr0[None, :] + block[:, None] * tp.stride).ravel()
    blocks = np.repeat(block, tp.addr0.size)
    return starts, np.full(starts.shape, tp.page_bytes, dtype=np.int64), blocks


#: Bumped whenever what the fingerprint covers changes.
_FINGERPRINT_VERSION: Final = 2


def _fingerprint(geometries: list[TensorGeometry], record_bytes: int, model_id: str) -> str:
    """What makes a record's bytes meaningful (docs/design.md §9.3), and nothing else: every page in
    record order with its dtype, shape, bytes and record offset; the record size; the model id. Not
    the number of device blocks, tensor names or addresses."""
    pages = [
        [g.dtype, list(g.shape[g.block_dim + 1 :]), g.page_bytes, offset]
        for g in geometries
        for offset in g.host_offsets
    ]
    payload = json.dumps(
        {"version": _FINGERPRINT_VERSION, "model_id": model_id, "record_bytes": record_bytes,
         "pages": pages},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()
