"""Promises the documentation makes, each kept by a test named after it: a file that is not a tier is
never overwritten, warm restart survives an engine restart with another number of device blocks, the
host pool view is exactly the pool, bad ids and layouts are named, a pool too large for the machine
is refused with the numbers, and the constructors point to ``create``."""

from __future__ import annotations

import os
import pathlib
import pydoc
import sys

import numpy as np
import pytest
import torch

import kvoffload
from kvoffload import (
    ArgumentTypeError,
    BlockIdTypeError,
    DeviceLayout,
    DiskConfig,
    DiskErrorKind,
    DiskFormatError,
    LayoutError,
    Manager,
    RegionError,
    Worker,
)
from kvoffload.region import host_memory_available

TIMEOUT_S = 60.0


def layout_of(num_blocks: int, *, seed: int = 0, model_id: str = "") -> DeviceLayout:
    """Two per-layer tensors ``[2, num_blocks, 8, 2, 64]`` of random bf16 bits."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        f"layer{i}": torch.randint(-(2**15), 2**15, (2, num_blocks, 8, 2, 64), dtype=torch.int16,
                                   generator=gen).view(torch.bfloat16)
        for i in range(2)
    }
    return DeviceLayout.from_tensors(tensors, block_dim=1, num_blocks=num_blocks, model_id=model_id)


# ------------------------------------------------------------------ a file that is not a tier


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reuse"])
@pytest.mark.parametrize(
    "content",
    [b"\0" * 4096 + b"precious" * 100, b"precious user data\n" * 300, b"\0" * 8192],
    ids=["zero-first-page", "text", "all-zero"],
)
def test_a_file_that_is_not_a_tier_is_never_overwritten(
    tmp_path: pathlib.Path, content: bytes, reuse: bool
) -> None:
    path = tmp_path / "precious.bin"
    path.write_bytes(content)
    with pytest.raises(DiskFormatError) as info:
        Worker.create(layout_of(8), 4, disk=DiskConfig(str(path), 16, reuse=reuse))
    assert info.value.kind == DiskErrorKind.NOT_A_TIER
    assert str(path) in str(info.value)
    assert path.read_bytes() == content


def test_a_missing_or_empty_file_becomes_a_tier(tmp_path: pathlib.Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    for path in (empty, tmp_path / "missing.bin"):
        with Worker.create(layout_of(8), 4, disk=DiskConfig(str(path), 16)) as w:
            assert w.disk_valid_blocks() == {}
        assert path.read_bytes()[:8] == b"KVOFDISK"


# ------------------------------------------------------------------ warm restart


@pytest.mark.parametrize("restart_blocks", [32, 128])
def test_warm_restart_serves_every_record_after_the_device_cache_was_resized(
    tmp_path: pathlib.Path, restart_blocks: int
) -> None:
    path = str(tmp_path / "kv.bin")
    first = layout_of(64, seed=1, model_id="tiny@1")
    blocks = np.arange(0, 64, 2)  # 32 records written from the 64-block cache
    expected = first.gather_records(blocks)
    with Worker.create(first, 4, disk=DiskConfig(path, 64)) as w:
        w.store_to_disk(1, blocks, np.arange(32))
        (stored,) = w.wait([1], TIMEOUT_S)
        assert stored.ok, stored.error
    second = layout_of(restart_blocks, seed=2, model_id="tiny@1")
    assert second.fingerprint == first.fingerprint
    with Worker.create(second, 4, disk=DiskConfig(path, 64, reuse=True)) as w:
        assert set(w.disk_valid_blocks()) == set(range(32))
        targets = np.arange(32) % restart_blocks
        for start in range(0, 32, restart_blocks):  # a 32-block cache takes them in one pass
            part = slice(start, start + restart_blocks)
            w.load_from_disk(2 + start, np.arange(32)[part], targets[part])
            (loaded,) = w.wait([2 + start], TIMEOUT_S)
            assert loaded.ok, loaded.error
            assert torch.equal(second.gather_records(targets[part]), expected[part])


def test_warm_restart_refuses_records_of_another_model(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "kv.bin")
    with Worker.create(layout_of(8, model_id="a"), 4, disk=DiskConfig(path, 8)) as w:
        w.store_to_disk(1, [0], [0])
        assert w.wait([1], TIMEOUT_S)[0].ok
    with pytest.raises(DiskFormatError) as info:
        Worker.create(layout_of(8, model_id="b"), 4, disk=DiskConfig(path, 8, reuse=True))
    assert info.value.kind == DiskErrorKind.FINGERPRINT_MISMATCH


# ------------------------------------------------------------------ the host pool view


def test_host_records_is_exactly_the_pool_without_the_bounce_slots(tmp_path: pathlib.Path) -> None:
    layout = layout_of(8)
    with Worker.create(layout, 16, disk=DiskConfig(str(tmp_path / "kv.bin"), 8)) as w:
        records = w.host_records()
        assert tuple(records.shape) == (16, layout.record_bytes)
    with Worker.create(layout, 16) as w:
        assert tuple(w.host_records().shape) == (16, layout.record_bytes)


# ------------------------------------------------------------------ ids and layouts


@pytest.mark.parametrize(
    "ids",
    [[1, 2], (1, 2), np.array([1, 2], dtype=np.int32), torch.tensor([1, 2]), range(1, 3)],
    ids=["list", "tuple", "numpy", "tensor", "range"],
)
def test_block_ids_of_every_documented_kind_are_accepted(ids: kvoffload.BlockIds) -> None:
    with Worker.create(layout_of(8), 4) as w:
        w.store(1, ids, [0, 3])
        assert w.wait([1], TIMEOUT_S)[0].ok


@pytest.mark.parametrize(
    ("ids", "kind"),
    [({1, 2}, "set"), (frozenset({1}), "frozenset"), ({1: 0}, "dict"), ((i for i in range(2)), "generator")],
    ids=["set", "frozenset", "dict", "generator"],
)
def test_an_unordered_or_one_shot_collection_of_ids_is_named(ids: object, kind: str) -> None:
    with Worker.create(layout_of(8), 4) as w:
        with pytest.raises(BlockIdTypeError, match=f"got a {kind}"):
            w.store(1, ids, [0, 1])  # type: ignore[arg-type]
        assert w.stats().store.submitted == 0


def test_num_blocks_catches_a_wrong_block_dim() -> None:
    tensors = {"l0": torch.zeros(2, 32, 8, 2, 64, dtype=torch.bfloat16)}
    with pytest.raises(LayoutError, match=r"has 2 blocks along block dim 0 .* num_blocks = 32"):
        DeviceLayout.from_tensors(tensors, block_dim=0, num_blocks=32)
    assert DeviceLayout.from_tensors(tensors, block_dim=1, num_blocks=32).num_blocks == 32
    with pytest.raises(ArgumentTypeError):
        DeviceLayout.from_tensors(tensors, block_dim=1, num_blocks="32")  # type: ignore[arg-type]
    for bad in (0, -1):  # blamed block_dim before
        with pytest.raises(LayoutError, match=rf"num_blocks = {bad} must be >= 1"):
            DeviceLayout.from_tensors(tensors, block_dim=1, num_blocks=bad)


def test_the_layout_repr_is_a_one_line_summary() -> None:
    text = repr(layout_of(4096))
    assert "\n" not in text and len(text) < 300
    assert "4096 blocks" in text and "2 tensors" in text and "tensor(" not in text


# ------------------------------------------------------------------ memory


def test_a_pool_larger_than_the_memory_available_is_refused_before_mapping() -> None:
    available = host_memory_available()
    if available is None:
        pytest.skip("this platform reports no available memory")
    layout = layout_of(8)
    blocks = 2 * available[0] // layout.record_bytes + 1
    with pytest.raises(RegionError) as info:
        Worker.create(layout, blocks)
    message = str(info.value)
    assert "GiB" in message and available[1] in message and "fewer host blocks" in message


def test_available_memory_is_the_smaller_of_memavailable_and_the_cgroup_room(
    tmp_path: pathlib.Path,
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable: 4194304 kB\n")  # 4 GiB
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_memory_available(str(meminfo), str(cgroup)) == (4 << 30, "MemAvailable")
    (cgroup / "memory.max").write_text(f"{3 << 30}\n")
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert host_memory_available(str(meminfo), str(cgroup)) == (2 << 30, "cgroup memory.max")
    (cgroup / "memory.max").write_text("max\n")
    assert host_memory_available(str(meminfo), str(cgroup)) == (4 << 30, "MemAvailable")


# ------------------------------------------------------------------ constructors


def test_the_constructors_point_to_create() -> None:
    with pytest.raises(ArgumentTypeError, match=r"Manager\.create\(num_host_blocks"):
        Manager(16)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"Worker\.create\(layout, num_host_blocks"):
        Worker(layout_of(8))  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [Worker, Manager])
def test_help_starts_with_how_to_build_the_object(cls: type) -> None:
    text = pydoc.render_doc(cls, renderer=pydoc.TextDoc())
    head = "\n".join(text.splitlines()[:8])
    assert f"{cls.__name__}.create" in head, head


# ------------------------------------------------------------------ the public surface


def test_everything_a_caller_can_catch_or_pass_is_public_and_listed_in_the_readme() -> None:
    import kvoffload.errors

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name in kvoffload.errors.__all__:
        assert name in kvoffload.__all__, name
        assert f"`{name}`" in readme, f"{name} is not in README.md"
    for name in ("DiskConfig", "DiskStats", "DiskRecordInfo", "DiskErrorKind", "BlockIds",
                 "BackendName", "PathName", "PolicyFactory"):
        assert name in kvoffload.__all__ and getattr(kvoffload, name) is not None, name
        assert f"`{name}" in readme, f"{name} is not in README.md"
    assert set(kvoffload.__all__) <= set(dir(kvoffload))


def test_the_public_surface_loads_without_torch_until_a_torch_name_is_used() -> None:
    import subprocess

    code = (
        "import sys, kvoffload\n"
        "from kvoffload import DiskError, BlockIds, KeyStateError, PolicyFactory, DiskConfig\n"
        "assert 'torch' not in sys.modules\n"
        "kvoffload.DeviceLayout\n"
        "assert 'torch' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[2])})
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ the design document


def test_docstrings_cite_only_the_design_document_in_the_repository() -> None:
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    design = (root / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^#+ (\d+(?:\.\d+)?)\.? ", design, re.MULTILINE))
    stale = re.compile(r"DESIGN §|FACTS §|FACTS\.md|DESIGN\.md|\bissue \d+\b|\.\./shared")
    for path in list(root.glob("kvoffload/**/*.py")) + list(root.glob("tests/**/*.py")):
        text = path.read_text()
        if path.name == "test_promises.py":
            continue
        assert not stale.search(text), f"{path} cites a document outside the repository"
        for section in re.findall(r"docs/design\.md §(\d+(?:\.\d+)?)", text):
            assert section in sections, f"{path} cites docs/design.md §{section}, which does not exist"
