"""Narrow layers grouped: a ``staged`` layered load whose layers' spans of a record are narrow and
whose host records lie apart moves consecutive layers as one span (docs/design.md §12, *Narrow
layers grouped for staged*).

A layer of a per-layer layout is a narrow byte range of each record (two 4 KiB pages: 8 KiB), and
from records apart the ``staged`` path moves every such range as a descriptor of its own, which the
copy engine moves at a fraction of the link below 32 KiB. A record holds its layers side by side,
so ``size`` consecutive layers are one range ``size`` times as wide: the job is handed to its
backend as a layered job of groups (to the backend a group is a layer), and :class:`GroupedMarks`
shows its caller every layer, a layer waiting for its group.

Decides and describes; owns nothing (:class:`GroupedMarks` borrows its group marks, which the
handler owns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np

from kvoffload._descriptors import PageTable
from kvoffload._layer_load import LayerMarks
from kvoffload.errors import WaitTimeoutError

__all__ = ["GROUP_MIN_SPAN_BYTES", "GroupedMarks", "group_size", "grouped"]

#: Layers whose byte ranges of a record average under this are grouped, as few a group as make the
#: groups' ranges average at least this: on two H100 hosts ``staged`` layered loads from every
#: other record moved 8 KiB ranges at 0.12-0.30x a pinned copy, 16 KiB at 0.51-0.57x and 32 KiB at
#: 0.64-0.88x (docs/design.md §12).
GROUP_MIN_SPAN_BYTES: Final = 32 << 10


def _mean_span(tables: Sequence[PageTable]) -> float:
    """The mean width of the byte ranges of a record the tables' pages fill (merged where they
    follow each other within a table), 0.0 for none."""
    runs = [table.record_runs()[1] for table in tables]
    count = sum(int(sizes.shape[0]) for sizes in runs)
    return sum(int(sizes.sum()) for sizes in runs) / count if count else 0.0


def grouped(tables: Sequence[PageTable], size: int) -> tuple[PageTable, ...]:
    """``tables`` (a layout's layers, 0 first) as groups of ``size`` consecutive layers, the last
    perhaps smaller: each group one table of its layers' pages, in host-record order."""
    if size < 1:
        raise ValueError(f"size = {size} must be at least 1")
    out = []
    for first in range(0, len(tables), size):
        part = tables[first:first + size]
        offsets = np.concatenate([t.host_offset for t in part])
        order = np.argsort(offsets, kind="stable")  # a page table's pages are in host-record order
        out.append(PageTable(
            dev_base=np.concatenate([t.dev_base for t in part])[order],
            dev_stride=np.concatenate([t.dev_stride for t in part])[order],
            nbytes=np.concatenate([t.nbytes for t in part])[order], host_offset=offsets[order],
            segment=np.concatenate([t.segment for t in part])[order], record_bytes=part[0].record_bytes,
        ))
    return tuple(out)


def group_size(tables: Sequence[PageTable]) -> int:
    """How many consecutive layers a group holds: 1 where the layers' ranges already average
    :data:`GROUP_MIN_SPAN_BYTES` (or there is at most one layer), else the fewest whose groups'
    ranges do; 1 where no grouping gets there: the layers' ranges of a record do not follow each
    other (a group's are no wider), or all of them together average under it (a record that
    small moves fast enough layer by layer)."""
    if len(tables) < 2 or _mean_span(tables) >= GROUP_MIN_SPAN_BYTES:
        return 1
    if _mean_span(grouped(tables, len(tables))) < GROUP_MIN_SPAN_BYTES:
        return 1
    for size in range(2, len(tables) + 1):
        if _mean_span(grouped(tables, size)) >= GROUP_MIN_SPAN_BYTES:
            return size
    return 1


class GroupedMarks:
    """The marks of a layered job issued as groups of ``size`` layers, shown as its ``layers``
    layers: layer ``i`` waits for group ``i // size`` (every layer of a group lands with it).
    Borrows ``inner``, the groups' marks (the handler owns and releases them)."""

    def __init__(self, inner: LayerMarks, size: int, layers: int) -> None:
        if size < 1 or layers < 1 or inner.count != -(-layers // size):
            raise ValueError(f"{layers} layers in {inner.count} groups of {size}")
        self.inner = inner
        self.size = size
        self._layers = layers

    @property
    def count(self) -> int:
        """Layers of the job."""
        return self._layers

    @property
    def on_device(self) -> bool:
        """As the groups' marks."""
        return bool(getattr(self.inner, "on_device", False))

    def wait(self, layer: int, stream: object | None, timeout_s: float) -> bool:
        """The group of ``layer``'s wait (see :meth:`LayerMarks.wait`)."""
        group = layer // self.size
        try:
            return self.inner.wait(group, stream, timeout_s)
        except WaitTimeoutError as exc:  # it names the group: say the layer
            first = group * self.size
            raise WaitTimeoutError(str(exc).replace(
                f"layer {group}", f"layer {layer} (moved with layers {first}-"
                                  f"{min(first + self.size, self._layers) - 1})", 1)) from None

    def settle(self) -> None:
        """As the groups' marks."""
        self.inner.settle()

    def release(self) -> None:
        """As the groups' marks."""
        self.inner.release()
