"""DeviceLayout.from_tensors on CPU tensors: page geometry, the host record map, aliasing, the
record round trip and every LayoutError rule (docs/design.md §2)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import pytest
import torch

from kvoffload import (
    ArgumentTypeError, BlockIdTypeError, DeviceLayout, InvalidArgumentError, InvalidBlockIdError, LayoutError,
    Worker,
)
from kvoffload import layout as layout_module
from kvoffload.layout import PAGE_ALIGN_BYTES, RECORD_ALIGN_BYTES

BF16 = 2  # bytes per bfloat16 element
N = 6  # blocks in most layouts below
BS, HEADS, DIM = 4, 2, 8  # block size, heads, head dim: one K or V page is 4 * 2 * 8 * 2 = 128 bytes
KV_PAGE = BS * HEADS * DIM * BF16

_gen = torch.Generator().manual_seed(1234)


def rand_bf16(*shape: int) -> torch.Tensor:
    """A fresh bf16 tensor of random bytes (never zeros: a copy that misses a byte shows)."""
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * BF16), dtype=torch.uint8, generator=_gen)
    return raw.view(torch.bfloat16)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


# ----------------------------------------------------------------------------- layouts under test

LayoutArgs = tuple[Mapping[str, torch.Tensor] | Sequence[torch.Tensor], int | Mapping[str, int]]


def per_layer() -> LayoutArgs:
    return {"l0": rand_bf16(2, N, BS, HEADS, DIM), "l1": rand_bf16(2, N, BS, HEADS, DIM)}, 1


def block_major_kv() -> LayoutArgs:
    return {"l0": rand_bf16(N, 2, BS, HEADS, DIM), "l1": rand_bf16(N, 2, BS, HEADS, DIM)}, 0


def mla() -> LayoutArgs:
    return {"l0": rand_bf16(N, BS, 576), "l1": rand_bf16(N, BS, 576)}, 0


def cross_layer() -> LayoutArgs:
    return {"kv": rand_bf16(N, 3, 2, BS, HEADS, DIM)}, 0


def separate_k_v() -> LayoutArgs:
    names = ("k0", "v0", "k1", "v1")
    return {name: rand_bf16(N, BS, HEADS, DIM) for name in names}, 0


def mixed_block_dims() -> LayoutArgs:
    tensors = {
        "kv": rand_bf16(2, N, BS, HEADS, DIM),
        "mla": rand_bf16(N, BS, 576),
        "neg": rand_bf16(2, N, BS, HEADS, DIM),
    }
    return tensors, {"kv": 1, "mla": 0, "neg": -4}


def negative_block_dim() -> LayoutArgs:
    return {"l0": rand_bf16(2, N, BS, HEADS, DIM), "l1": rand_bf16(2, N, BS, HEADS, DIM)}, -4


def sequence_input() -> LayoutArgs:
    return [rand_bf16(2, N, BS, HEADS, DIM), rand_bf16(2, N, BS, HEADS, DIM)], 1


def padded_pages() -> LayoutArgs:
    """Pages of 24 bytes at a block stride of 32 bytes: host offsets must be padded to 16."""
    return {"a": rand_bf16(2, N, 16)[..., :12], "b": rand_bf16(2, N, 16)[..., :12]}, 1


def same_tensor_twice() -> LayoutArgs:
    t = rand_bf16(2, N, BS, HEADS, DIM)
    return {"a": t, "b": t}, 1


def identical_views() -> LayoutArgs:
    t = rand_bf16(2, N, BS, HEADS, DIM)
    return {"a": t.view(2, N, BS, HEADS, DIM), "b": t.view(2, N, BS * HEADS * DIM)}, 1


def k_view_of_kv() -> LayoutArgs:
    t = rand_bf16(2, N, BS, HEADS, DIM)
    return {"kv": t, "k": t[0]}, {"kv": 1, "k": 0}


LAYOUTS: dict[str, Callable[[], LayoutArgs]] = {
    "per-layer": per_layer,
    "block-major-kv": block_major_kv,
    "mla": mla,
    "cross-layer": cross_layer,
    "separate-k-v": separate_k_v,
    "mixed-block-dims": mixed_block_dims,
    "negative-block-dim": negative_block_dim,
    "sequence-input": sequence_input,
    "padded-pages": padded_pages,
    "same-tensor-twice": same_tensor_twice,
    "identical-views": identical_views,
    "k-view-of-kv": k_view_of_kv,
}


def build(name: str) -> DeviceLayout:
    tensors, block_dim = LAYOUTS[name]()
    return DeviceLayout.from_tensors(tensors, block_dim)


def page_intervals(layout: DeviceLayout) -> list[tuple[int, int]]:
    table = layout.page_table
    return sorted(zip(table.host_offset.tolist(), table.nbytes.tolist()))


def brute_force_records(layout: DeviceLayout, blocks: Sequence[int]) -> torch.Tensor:
    """Records built page by page with plain indexing: ``t[outer..., block]`` per page."""
    out = torch.zeros((len(blocks), layout.record_bytes), dtype=torch.uint8)
    for geom in layout.geometries:
        t = layout.tensors[geom.name]
        outer_ranges = [range(n) for n in t.shape[: geom.block_dim]]
        for row, block in enumerate(blocks):
            for k, outer in enumerate(itertools.product(*outer_ranges)):
                page = as_bytes(t[tuple(outer) + (block,)])
                assert page.numel() == geom.page_bytes
                offset = geom.host_offsets[k]
                out[row, offset : offset + geom.page_bytes] = page
    return out


def payload_mask(layout: DeviceLayout) -> torch.Tensor:
    mask = torch.zeros(layout.record_bytes, dtype=torch.bool)
    for offset, size in page_intervals(layout):
        mask[offset : offset + size] = True
    return mask


# ------------------------------------------------------------------------ hand-computed geometry


def test_per_layer_tensor_has_two_pages_per_block_k_then_v() -> None:
    l0, l1 = rand_bf16(2, N, BS, HEADS, DIM), rand_bf16(2, N, BS, HEADS, DIM)
    layout = DeviceLayout.from_tensors({"l0": l0, "l1": l1}, block_dim=1)

    assert layout.num_blocks == N
    assert [g.name for g in layout.geometries] == ["l0", "l1"]
    for geom, offsets in zip(layout.geometries, [(0, 128), (256, 384)]):
        assert geom.block_dim == 1
        assert geom.page_bytes == KV_PAGE == 128
        assert geom.block_stride_bytes == 128
        assert geom.outer_count == 2
        assert geom.host_offsets == offsets
    assert layout.pages_per_block == 4
    assert layout.block_bytes == 512
    assert layout.record_bytes == 4096
    table = layout.page_table
    v_plane = N * KV_PAGE  # V of block 0 starts after the K plane of all blocks
    assert table.dev_base.tolist() == [
        l0.data_ptr(), l0.data_ptr() + v_plane, l1.data_ptr(), l1.data_ptr() + v_plane
    ]
    assert table.dev_stride.tolist() == [128] * 4
    assert table.host_offset.tolist() == [0, 128, 256, 384]
    assert table.segment.tolist() == [0, 0, 1, 1]


def test_block_major_kv_tensor_has_one_page_holding_k_and_v() -> None:
    layout = build("block-major-kv")
    for geom, offset in zip(layout.geometries, (0, 256)):
        assert geom.block_dim == 0
        assert geom.page_bytes == 2 * KV_PAGE == 256
        assert geom.block_stride_bytes == 256
        assert geom.outer_count == 1
        assert geom.host_offsets == (offset,)
    assert layout.pages_per_block == 2
    assert layout.block_bytes == 512
    assert layout.record_bytes == 4096


def test_mla_layout_has_one_page_per_layer_and_record_padded_to_4096() -> None:
    layout = build("mla")
    page = BS * 576 * BF16  # 4608
    assert [g.page_bytes for g in layout.geometries] == [page, page]
    assert [g.block_stride_bytes for g in layout.geometries] == [page, page]
    assert [g.host_offsets for g in layout.geometries] == [(0,), (page,)]
    assert layout.block_bytes == 9216
    assert layout.record_bytes == 12288  # 9216 rounded up to 3 * 4096


def test_cross_layer_tensor_is_one_page_per_block() -> None:
    layout = build("cross-layer")
    (geom,) = layout.geometries
    page = 3 * 2 * KV_PAGE  # layers * (K, V) * page
    assert (geom.page_bytes, geom.block_stride_bytes, geom.outer_count) == (page, page, 1)
    assert geom.host_offsets == (0,)
    assert layout.pages_per_block == 1
    assert layout.record_bytes == 4096


def test_separate_k_and_v_tensors_are_separate_pages_and_segments() -> None:
    layout = build("separate-k-v")
    assert [g.name for g in layout.geometries] == ["k0", "v0", "k1", "v1"]
    assert [g.host_offsets for g in layout.geometries] == [(0,), (128,), (256,), (384,)]
    assert layout.page_table.segment.tolist() == [0, 1, 2, 3]
    assert layout.block_bytes == 512


def test_block_dims_given_per_tensor_may_differ_and_be_negative() -> None:
    layout = build("mixed-block-dims")
    kv, mla_geom, neg = layout.geometries
    assert (kv.block_dim, mla_geom.block_dim, neg.block_dim) == (1, 0, 1)
    assert kv.host_offsets == (0, 128)
    assert mla_geom.host_offsets == (256,)
    assert mla_geom.page_bytes == 4608
    assert neg.host_offsets == (4864, 4992)
    assert layout.block_bytes == 5120
    assert layout.record_bytes == 8192


def test_negative_block_dim_counts_from_the_end() -> None:
    tensors, _ = per_layer()
    negative = DeviceLayout.from_tensors(tensors, block_dim=-4)
    positive = DeviceLayout.from_tensors(tensors, block_dim=1)
    assert negative.geometries == positive.geometries
    assert negative.fingerprint == positive.fingerprint
    assert all(g.block_dim == 1 for g in negative.geometries)


def test_sequence_input_is_named_by_position() -> None:
    layout = build("sequence-input")
    assert [g.name for g in layout.geometries] == ["0", "1"]
    assert list(layout.tensors) == ["0", "1"]
    assert [g.host_offsets for g in layout.geometries] == [(0, 128), (256, 384)]


def test_page_starts_are_padded_to_16_bytes_in_the_record() -> None:
    layout = build("padded-pages")
    for geom in layout.geometries:
        assert (geom.page_bytes, geom.block_stride_bytes) == (24, 32)
    # 24-byte pages each start on the next multiple of 16 after the previous page
    assert [g.host_offsets for g in layout.geometries] == [(0, 32), (64, 96)]
    assert layout.block_bytes == 96
    assert layout.record_bytes == 4096


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_record_map_is_aligned_disjoint_and_padded(name: str) -> None:
    layout = build(name)
    intervals = page_intervals(layout)
    table = layout.page_table
    assert all(offset % PAGE_ALIGN_BYTES == 0 for offset, _ in intervals)
    for (start, size), (next_start, _) in zip(intervals, intervals[1:]):
        assert start + size <= next_start, f"pages overlap in the record: {intervals}"
    end = intervals[-1][0] + intervals[-1][1]
    assert layout.record_bytes % RECORD_ALIGN_BYTES == 0
    assert end <= layout.record_bytes < end + RECORD_ALIGN_BYTES
    assert layout.pages_per_block == len(intervals) == table.num_pages
    assert layout.block_bytes == sum(size for _, size in intervals)
    assert table.record_bytes == layout.record_bytes
    listed = {o for g in layout.geometries for o in g.host_offsets}
    assert listed == set(table.host_offset.tolist())
    for geom in layout.geometries:
        assert len(geom.host_offsets) == geom.outer_count


# ---------------------------------------------------------------------------------- aliasing


def test_same_tensor_under_two_names_is_stored_once() -> None:
    layout = build("same-tensor-twice")
    a, b = layout.geometries
    assert a.host_offsets == b.host_offsets == (0, 128)
    assert layout.pages_per_block == 2
    assert layout.block_bytes == 256


def test_identical_views_of_one_memory_are_stored_once() -> None:
    layout = build("identical-views")
    a, b = layout.geometries
    assert a.page_bytes == b.page_bytes == 128
    assert a.host_offsets == b.host_offsets
    assert layout.pages_per_block == 2


def test_view_of_some_pages_shares_their_host_offsets() -> None:
    layout = build("k-view-of-kv")
    kv, k = layout.geometries
    assert k.host_offsets == (kv.host_offsets[0],)
    assert layout.pages_per_block == 2


def test_aliased_views_with_one_block_are_stored_once() -> None:
    base = rand_bf16(64, 1)
    transposed, contiguous = base.t(), base.view(1, 64)  # same bytes; strides (1, 1) vs (64, 1)
    layout = DeviceLayout.from_tensors({"a": transposed, "b": contiguous}, block_dim=0)
    assert layout.pages_per_block == 1


# ------------------------------------------------------------------------- gather and scatter


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gather_records_matches_page_by_page_reference(name: str) -> None:
    layout = build(name)
    blocks = [4, 0, 5, 2]
    records = layout.gather_records(blocks)
    assert records.dtype == torch.uint8
    assert tuple(records.shape) == (len(blocks), layout.record_bytes)
    assert torch.equal(records, brute_force_records(layout, blocks))
    assert not bool(records[:, ~payload_mask(layout)].any()), "padding bytes must be zero"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scatter_then_gather_returns_the_same_records(name: str) -> None:
    layout = build(name)
    blocks = [3, 1, 5]
    others = [b for b in range(layout.num_blocks) if b not in blocks]
    untouched = layout.gather_records(others)
    records = torch.randint(0, 256, (len(blocks), layout.record_bytes), dtype=torch.uint8, generator=_gen)
    records[:, ~payload_mask(layout)] = 0
    assert not torch.equal(records, layout.gather_records(blocks))  # the scatter must change them

    layout.scatter_records(blocks, records)

    assert torch.equal(layout.gather_records(blocks), records)
    assert torch.equal(brute_force_records(layout, blocks), records)
    assert torch.equal(layout.gather_records(others), untouched)


def test_gather_and_scatter_check_their_blocks_and_records() -> None:
    """The reference map takes ids as a job does (floats and bools once read as blocks 2, 3, 1, 0)
    and refuses records of the wrong kind or shape, changing nothing."""
    layout = build("per-layer")
    before = layout.gather_records(list(range(layout.num_blocks)))
    good = torch.zeros((2, layout.record_bytes), dtype=torch.uint8)
    for blocks, error, words in (
        ([2.9, 3.2], BlockIdTypeError, r"blocks\[0\] = 2.9 is a float"),
        ([True, False], BlockIdTypeError, r"blocks\[0\] = True is a bool"),
        ([-1, 0], InvalidBlockIdError, r"blocks\[0\] = -1 is out of range"),
        ([0, layout.num_blocks], InvalidBlockIdError, r"blocks\[1\] = \d+ is out of range"),
        ([1, 1], InvalidBlockIdError, r"blocks\[1\] = 1 repeats an earlier block"),
    ):
        with pytest.raises(error, match=words):
            layout.scatter_records(blocks, good)  # type: ignore[arg-type]
        if words.endswith("earlier block"):
            layout.gather_records(blocks)  # type: ignore[arg-type]  # a gather may read a block twice
        else:
            with pytest.raises(error, match=words):
                layout.gather_records(blocks)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="records must be a uint8 tensor, got list"):
        layout.scatter_records([0, 1], [good[0], good[1]])  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="got a torch.int32 tensor"):
        layout.scatter_records([0, 1], good.to(torch.int32))
    with pytest.raises(InvalidArgumentError, match=r"records has shape \(2, \d+\); it must be \[2, "):
        layout.scatter_records([0, 1], torch.zeros((2, layout.record_bytes + 1), dtype=torch.uint8))
    assert torch.equal(layout.gather_records(list(range(layout.num_blocks))), before)
    layout.scatter_records(torch.tensor([0, 1]), good)  # ids as a tensor, as before
    assert not bool(layout.gather_records([0, 1]).any())


# ------------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_equal_for_equal_geometry_of_other_tensors() -> None:
    first, second = build("per-layer"), build("per-layer")
    assert first.page_table.dev_base.tolist() != second.page_table.dev_base.tolist()
    assert first.fingerprint == second.fingerprint


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: ({"l0": rand_bf16(2, N, BS, HEADS, 2 * DIM)}, 1), id="page-shape"),
        pytest.param(
            lambda: ({"l0": rand_bf16(2, N, BS, HEADS, DIM).view(torch.float16)}, 1), id="dtype"
        ),
        pytest.param(lambda: ({"l0": rand_bf16(2, N, BS, HEADS, DIM)}, 2), id="block-dim"),
    ],
)
def test_fingerprint_changes_with_page_shape_dtype_or_block_dim(other: Callable[[], LayoutArgs]) -> None:
    reference = DeviceLayout.from_tensors({"l0": rand_bf16(2, N, BS, HEADS, DIM)}, 1)
    tensors, block_dim = other()
    assert DeviceLayout.from_tensors(tensors, block_dim).fingerprint != reference.fingerprint


def test_fingerprint_does_not_depend_on_the_number_of_device_blocks_or_tensor_names() -> None:
    reference = DeviceLayout.from_tensors({"l0": rand_bf16(2, N, BS, HEADS, DIM)}, 1)
    for blocks in (N // 2, N + 1, 4 * N):
        other = DeviceLayout.from_tensors({"renamed": rand_bf16(2, blocks, BS, HEADS, DIM)}, 1)
        assert other.fingerprint == reference.fingerprint


def test_fingerprint_changes_with_the_model_id_and_the_order_of_tensors() -> None:
    a, b = rand_bf16(2, N, BS, HEADS, DIM), rand_bf16(2, N, BS, HEADS, 2 * DIM)
    plain = DeviceLayout.from_tensors({"a": a, "b": b}, 1)
    assert DeviceLayout.from_tensors({"a": a, "b": b}, 1, model_id="m@1").fingerprint != plain.fingerprint
    assert DeviceLayout.from_tensors({"b": b, "a": a}, 1).fingerprint != plain.fingerprint


# ------------------------------------------------------------------------------- LayoutError


def _any(value: object) -> Any:
    """An intentionally ill-typed argument (the runtime check is under test)."""
    return value


def _misaligned_outer_page() -> torch.Tensor:
    # outer stride of N*64 + 1 elements: page 0 aligned, page 1 two bytes off
    storage = rand_bf16(2 * N * 64 + 8)
    return storage.as_strided((2, N, 64), (N * 64 + 1, 64, 1))


def _shifted_by_16_bytes() -> dict[str, torch.Tensor]:
    flat = rand_bf16((N + 1) * 64)
    return {"a": flat[: N * 64].view(N, 64), "b": flat[8 : 8 + N * 64].view(N, 64)}


def _meta_and_cpu() -> dict[str, torch.Tensor]:
    try:
        meta = torch.empty(N, 64, dtype=torch.bfloat16, device="meta")
    except (RuntimeError, NotImplementedError) as exc:  # pragma: no cover - torch-dependent
        pytest.skip(f"this torch cannot make meta tensors: {exc}")
    return {"a": rand_bf16(N, 64), "b": meta}


def _shared_kv() -> torch.Tensor:
    return rand_bf16(N, 2, 16)


_kv = _shared_kv()
_kv_flat = rand_bf16(2 * N * 64 + 8)

LAYOUT_ERRORS: list[Any] = [
    pytest.param(
        _meta_and_cpu, 0,
        r"tensor 'b' is on meta but tensor 'a' is on cpu: all tensors of a layout must be on one device",
        id="mixed-devices",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(N, 64), "b": rand_bf16(N - 1, 64)}, 0,
        r"tensor 'b' has 5 blocks but tensor 'a' has 6: all tensors must have the same number of blocks",
        id="different-block-counts",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(N, 16, 4).transpose(1, 2)}, 0,
        r"tensor 'a': a page \(the dims after block dim 0, shape \(4, 16\)\) is not contiguous",
        id="page-not-contiguous",
    ),
    pytest.param(
        lambda: {"a": _kv_flat[1 : 1 + 2 * N * 64].view(2, N, 64)}, 1,
        r"tensor 'a': page 0 of block 0 starts at address 0x[0-9a-f]+, not 16-byte aligned",
        id="page-start-misaligned",
    ),
    pytest.param(
        lambda: {"a": _misaligned_outer_page()}, 1,
        r"tensor 'a': page 1 of block 0 starts at address 0x[0-9a-f]+, not 16-byte aligned",
        id="outer-page-misaligned",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(2, N, 68)[..., :64]}, 1,
        r"tensor 'a': block stride 136 bytes is not a multiple of 16",
        id="block-stride-misaligned",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(2, 0, 64)}, 1,
        r"tensor 'a' has zero blocks \(shape \(2, 0, 64\)\)",
        id="zero-blocks",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(N, 0, 64)}, 0,
        r"tensor 'a' has an empty dim \(shape \(6, 0, 64\)\)",
        id="empty-page",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(2, N, 64)}, 3,
        r"block dim 3 of tensor 'a' is out of range for its 3 dims \(shape \(2, 6, 64\)\)",
        id="block-dim-too-large",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(2, N, 64)}, -4,
        r"block dim -4 of tensor 'a' is out of range for its 3 dims",
        id="block-dim-too-negative",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(N, 64)}, _any(0.0),
        r"block dim of tensor 'a' must be an int, got 0\.0", id="block-dim-float",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(N, 64)}, _any(False),
        r"block dim of tensor 'a' must be an int, got False", id="block-dim-bool",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(N, 64), "b": rand_bf16(N, 64)}, {"a": 0},
        r"tensor 'b' has no entry in the block_dim mapping", id="block-dim-mapping-missing-tensor",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(N, 64)}, {"a": 0, "zz": 1},
        r"block_dim names tensors that are not in the layout: \['zz'\]",
        id="block-dim-mapping-unknown-tensor",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(N, 64)}, {},
        r"tensor 'a' has no entry in the block_dim mapping", id="block-dim-mapping-empty",
    ),
    pytest.param(
        lambda: {}, 0, r"tensors is empty: a layout needs at least one tensor", id="no-tensors-mapping",
    ),
    pytest.param(lambda: [], 0, r"tensors is empty", id="no-tensors-sequence"),
    pytest.param(
        lambda: {"a": rand_bf16(N, 64), "b": np.zeros((N, 64))}, 0,
        r"tensor 'b' is a ndarray, not a torch\.Tensor", id="not-a-tensor",
    ),
    pytest.param(
        lambda: rand_bf16(N, 64), 0,
        r"tensors must be a mapping or a sequence of tensors, not one tensor", id="single-tensor",
    ),
    pytest.param(
        lambda: 7, 0, r"tensors must be a mapping or a sequence of tensors, not int", id="not-a-mapping",
    ),
    pytest.param(
        lambda: {0: rand_bf16(N, 64)}, 0, r"tensor names must be str, got 0", id="name-not-str",
    ),
    pytest.param(
        lambda: {"a": rand_bf16(1, 1, 64).expand(2, N, 64)}, 1,
        r"tensor 'a': its pages overlap \(a stride of 0 bytes", id="expanded-stride-0",
    ),
    pytest.param(
        lambda: {"a": _kv[:-1], "b": _kv[1:]}, 0,
        r"tensors 'a' and 'b' partly overlap at address 0x[0-9a-f]+: pages must be either the same "
        r"bytes \(stored once\) or disjoint",
        id="same-bytes-under-two-block-ids",
    ),
    pytest.param(
        _shifted_by_16_bytes, 0, r"tensors 'a' and 'b' partly overlap", id="views-shifted-inside-a-page",
    ),
    pytest.param(
        lambda: {"kv": _kv, "k": _kv[:, 0]}, 0,
        r"tensors 'kv' and 'k' partly overlap", id="page-inside-a-larger-page",
    ),
]


@pytest.mark.parametrize(("make", "block_dim", "match"), LAYOUT_ERRORS)
def test_invalid_tensors_raise_layout_error_naming_tensor_and_rule(
    make: Callable[[], object], block_dim: object, match: str
) -> None:
    tensors = make()
    with pytest.raises(LayoutError, match=match) as info:
        DeviceLayout.from_tensors(_any(tensors), _any(block_dim))
    assert isinstance(info.value, ValueError)


def test_block_dim_mapping_with_extra_names_is_refused_naming_all_of_them() -> None:
    """Extra names next to a complete mapping are refused, not silently ignored."""
    t = rand_bf16(N, 64)
    assert DeviceLayout.from_tensors({"a": t}, {"a": 0}).num_blocks == N
    with pytest.raises(LayoutError, match=r"\['b', 'c'\]"):
        DeviceLayout.from_tensors({"a": t}, cast(Mapping[str, int], {"a": 0, "c": 0, "b": 0}))


# ------------------------------------------------------ tensors a layout cannot describe (a probe)


def _aliased_at_block_0() -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors whose block-0 pages are the same bytes, their later blocks apart (block strides
    of 256 and 384 bytes)."""
    raw = torch.zeros(4096 + 64, dtype=torch.uint8)
    raw = raw[(-raw.data_ptr()) % 64 :][:4096]
    a = raw[:1024].view(torch.float16).as_strided((2, 64), (128, 1))
    b = raw[:1024].view(torch.float16).as_strided((2, 64), (192, 1))
    return a, b


def test_a_page_shared_at_some_blocks_only_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepted before, and no record could land: a load of block 0 wrote the shared page from two
    records, the last one winning. The control (the check skipped) shows it."""
    a, b = _aliased_at_block_0()
    with pytest.raises(LayoutError, match="tensors 'a' and 'b' partly overlap"):
        DeviceLayout.from_tensors({"a": a, "b": b}, block_dim=0)
    monkeypatch.setattr(layout_module, "_check_no_partial_overlap", lambda pages, num_blocks: None)
    layout = DeviceLayout.from_tensors({"a": a, "b": b}, block_dim=0)
    a[1].fill_(1.0)
    b[1].fill_(2.0)
    with Worker.create(layout, 1) as w:
        w.store(1, [1], [0])
        assert w.wait([1], 10)[0].ok
        w.load(2, [0], [0])
        assert w.wait([2], 10)[0].ok
    assert not torch.equal(a[0], a[1])  # the hazard: block 0 of a holds b's bytes


@pytest.mark.parametrize("make", [
    lambda: torch.tensor([[1, 2], [3, 4]], dtype=torch.float32).to_sparse(),
    lambda: torch.quantize_per_tensor(torch.zeros(4, 64), 0.1, 0, torch.quint8),
    lambda: torch._efficientzerotensor((4, 64), dtype=torch.float16),
    lambda: torch.nested.nested_tensor([torch.zeros(64), torch.zeros(64)]),
], ids=["sparse", "quantized", "zero", "nested"])
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's own, on making such tensors
def test_a_tensor_without_plain_strided_memory_is_refused(make: Any) -> None:
    """(A quantized tensor was accepted and crashed gather_records; the others raised untyped
    errors.)"""
    with pytest.raises(LayoutError, match="tensor 't'"):
        DeviceLayout.from_tensors({"t": make()}, block_dim=0)


@pytest.mark.parametrize("size", [0, 256])
def test_a_tensor_past_the_end_of_its_storage_is_refused(size: int) -> None:
    """(A storage resized under its tensor was accepted: copies read and wrote memory past it, or
    crashed.)"""
    t = torch.zeros(6, 128, dtype=torch.float16)
    t.untyped_storage().resize_(size)
    with pytest.raises(LayoutError, match="tensor 't' spans .* a storage of"):
        DeviceLayout.from_tensors({"t": t}, block_dim=0)


def _raw_tensor(dtype: torch.dtype, raw: torch.Tensor) -> torch.Tensor:
    """A [6, 2, 16] tensor of ``dtype`` over the bytes of ``raw`` (6 * 2 * 16 bytes, any values)."""
    return torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), 0, (6, 2, 16), (32, 16, 1))


@pytest.mark.parametrize("dtype", [torch.bool, getattr(torch, "int4"), getattr(torch, "uint1")], ids=str)
def test_gather_and_scatter_move_raw_bytes_of_any_dtype(dtype: torch.dtype) -> None:
    """The reference reads and writes a page's bytes as the copy paths do. It read elements: a bool
    byte other than 0 or 1 came back as 1 (the control below shows torch doing so), and int4 or
    uint1 tensors raised ``NotImplementedError``."""
    raw = torch.randint(2, 256, (6 * 32,), dtype=torch.uint8, generator=_gen)
    t = _raw_tensor(dtype, raw)
    layout = DeviceLayout.from_tensors({"t": t}, block_dim=0)
    records = layout.gather_records([4, 1])
    assert torch.equal(records[:, :32], raw.view(6, 32)[[4, 1]])
    with Worker.create(layout, 2) as w:
        w.store(1, [4, 1], [0, 1])
        assert w.wait([1], 10)[0].ok
        assert torch.equal(w.host_records()[:2], records)
    new = torch.randint(2, 256, (2, layout.record_bytes), dtype=torch.uint8, generator=_gen)
    layout.scatter_records([0, 5], new)
    assert torch.equal(raw.view(6, 32)[[0, 5]], new[:, :32])
    if dtype == torch.bool:  # the control: torch's element-wise read normalises the bytes
        assert not torch.equal(t[[4, 1]].contiguous().view(torch.uint8).reshape(2, 32), records[:, :32])


def test_gather_and_scatter_of_a_conjugate_view_move_its_memory() -> None:
    """A ``conj()`` view's memory holds the unconjugated values, which the copy paths move; the
    reference read the conjugate (the control shows torch doing so)."""
    base = torch.randn(6, 8, dtype=torch.complex64, generator=_gen)
    view = base.conj()
    layout = DeviceLayout.from_tensors({"t": view}, block_dim=0)
    records = layout.gather_records([2, 3])
    assert torch.equal(records[:, :64], base[[2, 3]].view(torch.uint8))
    assert not torch.equal(view[[2, 3]].resolve_conj().view(torch.uint8), records[:, :64])  # control
    layout.scatter_records([0], records[:1])
    assert torch.equal(base[0], base[2])


def test_views_of_one_buffer_are_checked_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-layer K and V views of one cross-layer buffer: their spans all overlap, and the overlap
    check costs one block's pages (blocks step alike), not a page-by-page check per pair of views
    (5.8 s for 64 views of 20000 blocks before)."""
    buf = torch.zeros(20000, 32, 2, 64, dtype=torch.float16)
    views = {f"{kv}{layer}": buf[:, layer, i] for layer in range(32) for i, kv in enumerate("kv")}
    calls: list[int] = []
    monkeypatch.setattr(layout_module, "_check_page_by_page", lambda members, n: calls.append(len(members)))
    layout = DeviceLayout.from_tensors(views, block_dim=0)
    assert layout.pages_per_block == 64 and calls == []


def _strided(buf: torch.Tensor, offset: int, blocks: int, stride: int) -> torch.Tensor:
    return buf.as_strided((blocks, 16), (stride, 1), offset)


def test_pages_that_meet_only_modulo_the_block_stride_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``b``'s page lies where ``a``'s page of block 4 would be; with 4 blocks they never meet.
    ``a``'s second page keeps the spans overlapping; the quick check decides it exactly, and so
    does the page-by-page check (run below with the quick one off)."""
    calls: list[int] = []
    real = layout_module._check_page_by_page

    def counted(members: Any, n: int) -> None:
        calls.append(len(members))
        real(members, n)

    monkeypatch.setattr(layout_module, "_check_page_by_page", counted)
    for quick in (True, False):
        if not quick:
            monkeypatch.setattr(layout_module, "_disjoint_modulo_stride", lambda members, n: False)
        _round_trip_of_pages_meeting_modulo_the_stride()
        assert (calls == []) == quick
        calls.clear()


def _round_trip_of_pages_meeting_modulo_the_stride() -> None:
    buf = torch.zeros(4096, dtype=torch.uint8)
    base = (-buf.data_ptr()) % 16
    a = buf.as_strided((2, 4, 16), (1024, 64, 1), base)
    b = _strided(buf, base + 4 * 64, 4, 64)
    layout = DeviceLayout.from_tensors({"a": a, "b": b}, block_dim={"a": 1, "b": 0})
    assert layout.pages_per_block == 3
    a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8, generator=_gen))
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=_gen))
    want = (a.clone(), b.clone())
    with Worker.create(layout, 4) as w:
        w.store(1, [0, 1, 2, 3], [0, 1, 2, 3])
        assert w.wait([1], 10)[0].ok
        a.zero_()
        b.zero_()
        w.load(2, [0, 1, 2, 3], [0, 1, 2, 3])
        assert w.wait([2], 10)[0].ok
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])


def test_k_and_v_halves_of_per_layer_views_are_checked_from_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Views ``buf[:, :, layer]`` of a ``[2, blocks, layers, page]`` buffer: each view's K and V
    pages meet modulo the block stride (``blocks`` strides apart). With many blocks the
    page-by-page check of all views at once was over its bound and refused the layout."""
    monkeypatch.setattr(layout_module, "_MAX_INTERLEAVE_CHECK_PAGES", 1000)
    calls: list[int] = []
    monkeypatch.setattr(layout_module, "_check_page_by_page", lambda members, n: calls.append(len(members)))
    buf = torch.zeros(2, 600, 8, 16, dtype=torch.float16)
    layout = DeviceLayout.from_tensors({f"l{i}": buf[:, :, i] for i in range(8)}, block_dim=1)
    assert layout.pages_per_block == 16 and calls == []


def test_many_pages_that_meet_modulo_the_stride_are_checked_by_their_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Views ``buf[:, layer]`` of a ``[2, layers, blocks, page]`` buffer: all 2 * layers pages share
    one residue modulo the block stride, more than the quick check compares pair by pair; they are
    ``blocks`` strides apart or more, so they never meet (a page-by-page sort of every page before,
    and pair by pair past its bound)."""
    monkeypatch.setattr(layout_module, "_MAX_INTERLEAVE_CHECK_PAGES", 1000)
    calls: list[int] = []
    monkeypatch.setattr(layout_module, "_check_page_by_page", lambda members, n: calls.append(len(members)))
    buf = torch.zeros(2, 40, 300, 8, dtype=torch.float16)
    layout = DeviceLayout.from_tensors({f"l{i}": buf[:, i] for i in range(40)}, block_dim=1)
    assert layout.pages_per_block == 80 and calls == []


def test_a_group_over_the_bound_of_one_sort_is_checked_pair_by_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a pair of views may hold is the bound; a group of views over it in all is still
    checked (pair by pair, as before the groups), and a bad pair still refused."""
    monkeypatch.setattr(layout_module, "_disjoint_modulo_stride", lambda members, n: False)
    monkeypatch.setattr(layout_module, "_MAX_INTERLEAVE_CHECK_PAGES", 2 * 2 * 600)
    buf = torch.zeros(2, 600, 8, 16, dtype=torch.float16)
    layout = DeviceLayout.from_tensors({f"l{i}": buf[:, :, i] for i in range(8)}, block_dim=1)
    assert layout.pages_per_block == 16
    raw = torch.zeros(600 * 8 * 16 + 64, dtype=torch.float16)
    bad = {f"l{i}": raw[: 600 * 8 * 16].view(600, 8, 16)[:, i] for i in range(7)}
    bad["shifted"] = raw[8 : 600 * 8 * 16 + 8].view(600, 8, 16)[:, 0]  # half over l0, half over l1
    with pytest.raises(LayoutError, match="partly overlap"):
        DeviceLayout.from_tensors(bad, block_dim=0)


def test_the_same_bytes_under_two_block_ids_are_refused() -> None:
    """``b``'s block j is ``a``'s block j + 1: alike modulo the stride, and the same bytes under two
    block ids."""
    buf = torch.zeros(4096, dtype=torch.uint8)
    base = (-buf.data_ptr()) % 16
    a = _strided(buf, base, 4, 64)
    b = _strided(buf, base + 64, 4, 64)
    with pytest.raises(LayoutError, match="tensors 'a' and 'b' partly overlap"):
        DeviceLayout.from_tensors({"a": a, "b": b}, block_dim=0)
