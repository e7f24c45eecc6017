"""Layers of a layout and layer-by-layer loads on the host backend (docs/design.md §12).

The grouping: its defaults, its typed errors, and that the layers' pages are exactly the layout's
bytes (each byte in one layer, none missing, the record unchanged). The loads: every layout bit-exact
through ``load_by_layer``; a layer is waited for while later layers are still being copied (a copy
held in the last layer proves it), the whole job still comes through ``poll``/``wait``; bad
arguments are refused before anything is submitted.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvoffload import (
    ArgumentTypeError,
    BlockConflictError,
    ClosedError,
    DeviceLayout,
    DeviceMismatchError,
    InvalidArgumentError,
    KVOffloadError,
    LayerError,
    LayerLoad,
    LayoutError,
    ShutdownError,
    WaitTimeoutError,
    Worker,
)
from kvoffload._descriptors import CopyPlan, PageTable, plan_staged, plan_staged_part, staged_chunk_rows
from kvoffload._layer_load import LayerMarks
from kvoffload.backends.host import HostBackend, HostTicket
from kvoffload.cli.demo import LAYOUTS, build_cache
from kvoffload.records import Direction
from kvoffload.testing import FakeBackend

I64Array = npt.NDArray[np.int64]
TIMEOUT_S = 60.0
NUM_BLOCKS = 32
HOST_BLOCKS = 24
LAYERS = 3


def cache(kind: str, seed: int = 0, *, num_blocks: int = NUM_BLOCKS) -> DeviceLayout:
    tensors, block_dim = build_cache(
        kind, num_blocks=num_blocks, layers=LAYERS, kv_heads=2, head_dim=32, block_size=4,
        dtype=torch.bfloat16, device=torch.device("cpu"), seed=seed,
    )
    layer_dim = 1 if kind == "cross-layer" else None
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim, layer_dim=layer_dim)


def covered_bytes(table: PageTable) -> set[int]:
    return {o + i for o, n in zip(table.host_offset.tolist(), table.nbytes.tolist()) for i in range(n)}


# ------------------------------------------------------------------------------- the grouping


@pytest.mark.parametrize("kind", LAYOUTS)
def test_every_layout_has_its_layers_by_default_and_they_partition_the_record(kind: str) -> None:
    layout = cache(kind)
    assert layout.num_layers == LAYERS, layout.layers_missing
    per_layer = [covered_bytes(t) for t in layout.layer_tables]
    for i, a in enumerate(per_layer):
        for b in per_layer[i + 1 :]:
            assert not a & b, "a byte is in two layers"
    assert set().union(*per_layer) == covered_bytes(layout.page_table), "layers miss bytes"
    for t in layout.layer_tables:
        assert t.record_bytes == layout.record_bytes
        assert list(t.host_offset) == sorted(t.host_offset), "a layer's pages are in record order"


def test_separate_k_and_v_tensors_of_a_layer_are_one_layer() -> None:
    layout = cache("kv-separate")
    assert layout.layers == (("k0", "v0"), ("k1", "v1"), ("k2", "v2"))


def test_names_with_the_layer_number_anywhere_group_by_it() -> None:
    block = torch.zeros(8, 4, 16, dtype=torch.uint8)
    names = ["model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn", "model.layers.2.x"]
    layout = DeviceLayout.from_tensors({n: block.clone() for n in names}, block_dim=0)
    assert layout.layers == ((names[1],), (names[0],), (names[2],))


def test_a_sequence_of_tensors_is_one_layer_each() -> None:
    layout = DeviceLayout.from_tensors([torch.zeros(8, 64, dtype=torch.uint8) for _ in range(4)], 0)
    assert layout.layers == (("0",), ("1",), ("2",), ("3",))


def test_a_single_tensor_without_a_layer_dim_is_one_layer() -> None:
    layout = DeviceLayout.from_tensors({"kv": torch.zeros(8, 4, 64, dtype=torch.uint8)}, 0)
    assert layout.layers == (("kv",),)
    assert layout.layer_tables[0].block_bytes == layout.block_bytes


@pytest.mark.parametrize("names", [("k", "v"), ("a1b2", "c3"), ("layer1", "layer2"), ("l0", "l2")])
def test_names_that_do_not_say_the_layers_leave_the_layout_without_layers(names: tuple[str, ...]) -> None:
    layout = DeviceLayout.from_tensors({n: torch.zeros(8, 64, dtype=torch.uint8) for n in names}, 0)
    assert layout.layers is None and layout.num_layers is None
    assert "layers=" in layout.layers_missing
    with pytest.raises(LayerError, match="has no layers"):
        layout.require_layers()


@pytest.mark.parametrize("names", [("kv0", "kv1"), ("layer0", "cache1")])
def test_names_that_say_layers_of_one_memory_leave_the_layout_without_layers(names: tuple[str, ...]) -> None:
    """The names' default grouping put two views of one memory in two layers: ``from_tensors``
    raised, where names that do not tell the layers leave the layout without them (found by a
    review). An explicit grouping of the same tensors still raises."""
    t = torch.zeros(4, 2, 64, dtype=torch.uint8)
    layout = DeviceLayout.from_tensors({names[0]: t, names[1]: t.view(4, 128)}, 0)
    assert layout.layers is None and "share the same bytes" in layout.layers_missing
    with pytest.raises(LayerError, match="share the same bytes"):
        DeviceLayout.from_tensors({names[0]: t, names[1]: t.view(4, 128)}, 0, layers=[[names[0]], [names[1]]])


def test_load_by_layer_after_shutdown_is_closed_whatever_the_layout() -> None:
    """Every call after shutdown raises ``ClosedError``: ``load_by_layer`` on a layout without
    layers said ``LayerError`` there (found by a review)."""
    layout = DeviceLayout.from_tensors({n: torch.zeros(8, 4096, dtype=torch.uint8) for n in ("k", "v")}, 0)
    w = Worker.create(layout, 4)
    w.shutdown()
    with pytest.raises(ClosedError):
        w.load_by_layer(1, [0], [0])


def test_a_layer_dim_before_the_block_dim_selects_whole_pages() -> None:
    t = torch.zeros(4, 2, 8, 64, dtype=torch.uint8)  # [L, K/V, N, page]
    layout = DeviceLayout.from_tensors({"kv": t}, block_dim=2, layer_dim=0)
    assert layout.num_layers == 4
    for i, table in enumerate(layout.layer_tables):
        assert table.nbytes.tolist() == [64, 64]
        assert (table.dev_base - t.data_ptr()).tolist() == [(2 * i) * 8 * 64, (2 * i + 1) * 8 * 64]


def test_a_layer_dim_after_the_block_dim_selects_a_slice_of_every_page() -> None:
    t = torch.zeros(8, 2, 4, 32, dtype=torch.uint8)  # [N, K/V, L, 32 bytes]
    layout = DeviceLayout.from_tensors({"kv": t}, block_dim=0, layer_dim=2)
    assert layout.pages_per_block == 1 and layout.num_layers == 4
    for i, table in enumerate(layout.layer_tables):
        assert table.host_offset.tolist() == [i * 32, 128 + i * 32]
        assert table.nbytes.tolist() == [32, 32]
        assert (table.dev_base - t.data_ptr()).tolist() == [i * 32, 128 + i * 32]


def test_layers_never_change_the_record_or_the_fingerprint() -> None:
    tensors, block_dim = build_cache("per-layer", num_blocks=8, layers=4, kv_heads=2, head_dim=32,
                                     block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    default = DeviceLayout.from_tensors(tensors, block_dim)
    pairs = DeviceLayout.from_tensors(tensors, block_dim,
                                      layers=[["layer0", "layer1"], ["layer2", "layer3"]])
    assert pairs.num_layers == 2
    assert pairs.fingerprint == default.fingerprint and pairs.record_bytes == default.record_bytes
    assert np.array_equal(pairs.page_table.host_offset, default.page_table.host_offset)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([["layer0", "layer1"], ["layer1", "layer2"]], "tensor 'layer1' is in layer 0 and in layer 1"),
        ([["layer0"], [], ["layer1", "layer2"]], r"layers\[1\] is empty"),
        ([["layer0"], ["layer1"]], "do not cover tensor 'layer2'"),
        ([], "layers is empty"),
        ([["layer0", "nope"], ["layer1", "layer2"]], r"layers\[0\]\[1\] = 'nope' is not a tensor"),
        ([["layer0"], [("layer1", 0)], ["layer2"]], "has no layer dim"),
        ("layer0", "must be a sequence of layers"),
        ([["layer0"], "layer1", ["layer2"]], r"layers\[1\] = 'layer1' must be a sequence"),
        ([["layer0"], [3], ["layer1", "layer2"]], r"layers\[1\]\[0\] = 3 must be a tensor name"),
    ],
)
def test_a_bad_grouping_is_a_layer_error_naming_the_rule(layers: object, message: str) -> None:
    tensors, block_dim = build_cache("per-layer", num_blocks=8, layers=3, kv_heads=2, head_dim=32,
                                     block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    with pytest.raises(LayerError, match=message) as raised:
        DeviceLayout.from_tensors(tensors, block_dim, layers=layers)  # type: ignore[arg-type]
    assert isinstance(raised.value, LayoutError)


@pytest.mark.parametrize(
    ("layers", "layer_dim", "message"),
    [
        ([[("kv", 0)], [("kv", 1)]], 1, r"do not cover index 2 of tensor 'kv'"),
        ([[("kv", 0), ("kv", 0)], [("kv", 1)], [("kv", 2)]], 1, "index 0 of tensor 'kv' is twice in layer 0"),
        ([[("kv", 0)], [("kv", 1)], [("kv", 3)]], 1, "index 3 is out of range for layer dim 1"),
        ([["kv"]], 1, "name it as"),
        (None, 0, "is its block dim"),
        (None, 9, "out of range for its 6 dims"),
        (None, {"other": 1}, "names tensors that are not in the layout"),
        (None, "1", "must be an int, a mapping"),
    ],
)
def test_a_bad_layer_dim_grouping_is_a_layer_error(layers: object, layer_dim: object, message: str) -> None:
    tensors, _ = build_cache("cross-layer", num_blocks=8, layers=3, kv_heads=2, head_dim=32,
                             block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    with pytest.raises(LayerError, match=message):
        DeviceLayout.from_tensors(tensors, 0, layers=layers, layer_dim=layer_dim)  # type: ignore[arg-type]


def test_a_layer_slice_that_is_not_16_byte_aligned_is_refused() -> None:
    t = torch.zeros(8, 4, 8, dtype=torch.uint8)  # slices of 8 bytes
    with pytest.raises(LayerError, match="16-byte aligned"):
        DeviceLayout.from_tensors({"kv": t}, 0, layer_dim=1)


def test_aliased_tensors_must_be_in_one_layer() -> None:
    base = torch.zeros(8, 64, dtype=torch.uint8)
    tensors = {"a0": base, "b1": base[:, :]}  # the same bytes under two names
    with pytest.raises(LayerError, match="share the same bytes"):
        DeviceLayout.from_tensors(tensors, 0, layers=[["a0"], ["b1"]])
    layout = DeviceLayout.from_tensors(tensors, 0, layers=[["a0", "b1"]])
    assert layout.layer_tables[0].num_pages == 1


# --------------------------------------------------------------------------- staged layer plans


@pytest.mark.parametrize("edge_rows", [0, 1, 2])
def test_a_layers_staged_plan_moves_exactly_its_ranges_into_compact_rows(edge_rows: int) -> None:
    """Chunks of whole slots (5 rows each), or, with an edge chunk, chunks growing to whole slots
    towards the load's end (``staged_chunk_rows``): each row's ranges land in its chunk's slot."""
    layout = cache("kv-separate")
    host_base, slots = 1 << 40, (1 << 41, 1 << 42)
    src = np.array([7, 3, 9, 1, 4, 8, 2], dtype=np.int64)  # host blocks of a load
    dst = np.arange(7, dtype=np.int64) + 10
    record = layout.record_bytes
    for table in layout.layer_tables:
        plan = CopyPlan(table, host_base, 1 << 20, Direction.LOAD)
        compact = plan.compact
        offsets, sizes = plan.record_runs
        pitch = compact.pages.record_bytes
        assert pitch % 16 == 0 and pitch >= int(offsets[-1] + sizes[-1] - offsets[0])
        assert np.array_equal(compact.pages.host_offset, table.host_offset - offsets[0])
        rows = 5
        chunks = plan_staged_part(plan, src, dst, slots, rows * pitch + pitch - 1, first_slot=1,
                                  edge_bytes=edge_rows * pitch)
        taking = staged_chunk_rows(7, rows, edge_rows, False)
        assert taking == {0: [5, 2], 1: [1, 5, 1], 2: [5, 2]}[edge_rows]
        assert [c.slot for c in chunks] == [(1 + i) % 2 for i in range(len(taking))]
        order = np.argsort(src, kind="stable")
        chunk_of = np.repeat(np.arange(len(taking)), taking)
        starts = np.cumsum([0] + taking)
        want = set()
        for j, pair in enumerate(order):
            c = int(chunk_of[j])
            base = slots[(1 + c) % 2] + (j - starts[c]) * pitch
            for off, n in zip(offsets, sizes):
                want.add((int(base + off - offsets[0]), int(host_base + src[pair] * record + off), int(n)))
        got = {(int(d), int(s), int(n)) for c in chunks
               for d, s, n in zip(c.dma.dsts, c.dma.srcs, c.dma.sizes)}
        assert got == want
        assert np.array_equal(np.concatenate([c.device_blocks for c in chunks]), dst[order])


def test_a_compact_row_holds_many_more_blocks_than_a_record() -> None:
    layout = cache("per-layer")
    plan = CopyPlan(layout.layer_tables[1], 1 << 40, 1 << 20, Direction.LOAD)
    assert plan.compact.pages.record_bytes * LAYERS <= layout.record_bytes
    assert plan.compact.compact is plan.compact or plan.compact.pages.host_offset[0] == 0


def test_a_plan_of_whole_records_stages_as_before() -> None:
    layout = DeviceLayout.from_tensors({"kv": torch.zeros(8, 4096, dtype=torch.uint8)}, 0)
    plan = CopyPlan(layout.layer_tables[0], 1 << 40, 1 << 20, Direction.LOAD)
    assert plan.compact is plan
    src, dst = np.array([1, 2, 3], dtype=np.int64), np.array([4, 5, 6], dtype=np.int64)
    a = plan_staged_part(plan, src, dst, (1 << 41,), 8 * 4096)
    b = plan_staged(plan, src, dst, (1 << 41,), 8)
    assert [c.dma.count for c in a] == [c.dma.count for c in b] == [1]  # consecutive: one copy


# ------------------------------------------------------------------------- layer-by-layer loads


@pytest.mark.parametrize("kind", LAYOUTS)
def test_load_by_layer_is_bit_exact_for_every_layout(kind: str) -> None:
    layout = cache(kind, seed=len(kind))
    rng = np.random.default_rng(2)
    src = rng.choice(NUM_BLOCKS // 2, size=10, replace=False)
    dst = NUM_BLOCKS // 2 + rng.choice(NUM_BLOCKS // 2, size=10, replace=False)
    host = rng.choice(HOST_BLOCKS, size=10, replace=False)
    original = layout.gather_records(src)
    with Worker.create(layout, HOST_BLOCKS) as w:
        w.store(1, src, host)
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
        load = w.load_by_layer(2, host, dst)
        assert isinstance(load, LayerLoad) and load.num_layers == LAYERS and load.job_id == 2
        for layer in range(LAYERS):
            load.wait_layer(layer)
        (result,) = w.wait([2], TIMEOUT_S)
        assert result.ok and result.nbytes == 10 * layout.block_bytes
    assert torch.equal(layout.gather_records(dst), original)


class HeldLastLayer(HostBackend):
    """Copies of the last layer's pages wait until the test opens the gate."""

    def __init__(self, direction: Direction, held: set[int], gate: threading.Event) -> None:
        super().__init__(direction)
        self.held = held
        self.gate = gate

    def copy_one(self, dst: int, src: int, size: int) -> None:
        if self.direction is Direction.LOAD and dst in self.held:
            self.gate.wait(TIMEOUT_S)
        super().copy_one(dst, src, size)


def layer_bytes(layout: DeviceLayout, layer: int, blocks: list[int]) -> torch.Tensor:
    table = layout.layer_tables[layer]
    records = layout.gather_records(blocks)
    return torch.cat([records[:, o : o + n] for o, n in zip(table.host_offset.tolist(), table.nbytes.tolist())], 1)


@pytest.fixture
def held() -> Iterator[tuple[DeviceLayout, Worker, threading.Event]]:
    layout = cache("per-layer", seed=5)
    last = layout.layer_tables[-1]
    dst_blocks = [20, 21, 22]
    addresses = {int(b + d * s) for b, s in zip(last.dev_base.tolist(), last.dev_stride.tolist())
                 for d in dst_blocks}
    gate = threading.Event()
    w = Worker.create(layout, HOST_BLOCKS, backend_factory=lambda d: HeldLastLayer(d, addresses, gate))
    try:
        yield layout, w, gate
    finally:
        gate.set()
        w.shutdown()


def test_a_layer_is_ready_while_later_layers_are_still_being_copied(
    held: tuple[DeviceLayout, Worker, threading.Event],
) -> None:
    layout, w, gate = held
    src, dst, host = [1, 2, 3], [20, 21, 22], [4, 5, 6]
    w.store(1, src, host)
    assert all(r.ok for r in w.wait([1], TIMEOUT_S))
    before_last = layer_bytes(layout, LAYERS - 1, dst).clone()
    load = w.load_by_layer(2, host, dst)
    for layer in range(LAYERS - 1):
        load.wait_layer(layer)
        assert torch.equal(layer_bytes(layout, layer, dst), layer_bytes(layout, layer, src))
    assert w.poll() == [], "the job finished although its last layer is held"
    assert torch.equal(layer_bytes(layout, LAYERS - 1, dst), before_last), "the last layer landed early"
    with pytest.raises(WaitTimeoutError, match=f"layer {LAYERS - 1} did not land"):
        load.wait_layer(LAYERS - 1, timeout=0.05)
    with pytest.raises(WaitTimeoutError):
        w.wait([2], 0.05)  # the whole job is not done either
    gate.set()
    load.wait_layer(LAYERS - 1)
    (result,) = w.wait([2], TIMEOUT_S)
    assert result.ok
    assert torch.equal(layout.gather_records(dst), layout.gather_records(src))
    load.wait_layer(0)  # after the result: nothing to wait for


def test_a_layered_load_is_booked_like_a_load(held: tuple[DeviceLayout, Worker, threading.Event]) -> None:
    _, w, gate = held
    w.load_by_layer(1, [4, 5, 6], [20, 21, 22])
    with pytest.raises(BlockConflictError):
        w.store(2, [21], [9])  # a device block the layered load is filling
    with pytest.raises(BlockConflictError):
        w.store(3, [0], [5])  # a host record it reads
    gate.set()
    assert all(r.ok for r in w.wait([1], TIMEOUT_S))
    w.store(2, [21], [9])
    assert all(r.ok for r in w.wait([2], TIMEOUT_S))


def test_bad_wait_layer_arguments_are_refused() -> None:
    with Worker.create(cache("per-layer"), HOST_BLOCKS) as w:
        load = w.load_by_layer(1, [0, 1], [2, 3])
        with pytest.raises(InvalidArgumentError, match=f"layer = {LAYERS} is out of range"):
            load.wait_layer(LAYERS)
        with pytest.raises(InvalidArgumentError, match="out of range"):
            load.wait_layer(-1)
        with pytest.raises(ArgumentTypeError):
            load.wait_layer(True)
        with pytest.raises(ArgumentTypeError):
            load.wait_layer("0")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="timeout"):
            load.wait_layer(0, timeout=-1.0)
        with pytest.raises(InvalidArgumentError, match="timeout"):
            load.wait_layer(0, timeout=float("inf"))
        with pytest.raises(InvalidArgumentError, match="timeout = 1000+ must be finite"):
            load.wait_layer(0, timeout=10**400)
        with pytest.raises(ArgumentTypeError, match="timeout must be a number"):
            load.wait_layer(0, timeout="1")  # type: ignore[arg-type]
        with pytest.raises(DeviceMismatchError, match="takes no stream"):
            load.wait_layer(0, stream=object())
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
    with pytest.raises(ClosedError):
        load.wait_layer(0)


def test_a_layout_without_layers_is_refused_before_anything_is_submitted() -> None:
    tensors = {n: torch.zeros(NUM_BLOCKS, 64, dtype=torch.uint8) for n in ("k", "v")}
    with Worker.create(DeviceLayout.from_tensors(tensors, 0), HOST_BLOCKS) as w:
        with pytest.raises(LayerError, match="no layers"):
            w.load_by_layer(1, [0], [1])
        w.load(1, [0], [1])  # the id and the blocks are still free
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))


def test_an_empty_layered_load_completes_at_once() -> None:
    with Worker.create(cache("per-layer"), HOST_BLOCKS) as w:
        load = w.load_by_layer(1, [], [])
        assert load.on_device is False  # the host backend: a wait returns once the layer was copied
        load.wait_layer(LAYERS - 1, timeout=0.0)
        (result,) = w.wait([1], TIMEOUT_S)
        assert result.ok and result.nbytes == 0


def test_a_backend_that_cannot_mark_layers_makes_every_layer_wait_for_the_whole_job() -> None:
    backends: list[FakeBackend] = []

    def make(direction: Direction) -> FakeBackend:
        backends.append(FakeBackend(direction, auto_finish=False))
        return backends[-1]

    with Worker.create(cache("per-layer"), HOST_BLOCKS, backend_factory=make) as w:
        load = w.load_by_layer(1, [0, 1], [2, 3])
        assert load.on_device is False  # it waits on the host
        with pytest.raises(WaitTimeoutError, match="did not finish"):
            load.wait_layer(0, timeout=0.05)
        loads = backends[1]
        assert len(loads.issued) == 1, "a backend without issue_layers moves the job whole"
        loads.tickets[0].finish()
        load.wait_layer(0, timeout=TIMEOUT_S)
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))


def test_a_shutdown_that_gives_a_layered_load_up_ends_a_wait_layer_with_closed_error() -> None:
    """The job never finishes, so the shutdown gives it up; a ``wait_layer`` of 30 s in another
    thread ends with ``ClosedError`` within a slice of the shutdown, as ``Worker.wait`` does (it ran
    to its 30 s timeout: found by an API audit)."""
    def make(direction: Direction) -> FakeBackend:
        return FakeBackend(direction, auto_finish=direction is Direction.STORE)

    w = Worker.create(cache("per-layer"), HOST_BLOCKS, backend_factory=make)
    load = w.load_by_layer(1, [0, 1], [2, 3])
    ended: list[tuple[str, float]] = []

    def waiter() -> None:
        start = time.monotonic()
        try:
            load.wait_layer(0, timeout=30.0)
            ended.append(("returned", time.monotonic() - start))
        except KVOffloadError as exc:
            ended.append((type(exc).__name__, time.monotonic() - start))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)
    with pytest.raises(KVOffloadError, match="did not finish before the shutdown deadline"):
        w.shutdown(timeout=0.2)
    thread.join(30.0)
    assert not thread.is_alive()
    assert ended and ended[0][0] == "ClosedError", ended
    assert ended[0][1] < 5.0, ended
    with pytest.raises(ClosedError):
        load.wait_layer(1)


@pytest.mark.parametrize("timeout", [0.2, 5.0])
def test_a_wait_layer_ended_by_a_shutdown_that_gave_its_job_up_raises_closed_error(timeout: float) -> None:
    """Host backend, slow copies: a shutdown with no time to drain gives the layered load up,
    which settles its marks and ends the layer's wait; that wait raises ``ClosedError`` (it
    returned as if layer 3 had landed, in a short and a sliced wait alike: found by a lifecycle
    fuzz), and the layer's pages indeed never came."""
    class SlowCopies(HostBackend):
        def copy_one(self, dst: int, src: int, size: int) -> None:
            time.sleep(0.1)
            super().copy_one(dst, src, size)

    tensor = torch.zeros(4, 4, 64, dtype=torch.uint8)
    w = Worker.create(DeviceLayout.from_tensors([tensor], block_dim=0, layer_dim=1), 4,
                      backend_factory=SlowCopies)
    w.host_records()[2].fill_(0xAB)
    load = w.load_by_layer(1, [2], [0])
    ended: list[str] = []

    def waiter() -> None:
        try:
            load.wait_layer(3, timeout=timeout)
            ended.append("returned")
        except KVOffloadError as exc:
            ended.append(type(exc).__name__)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.02)
    with pytest.raises(ShutdownError):
        w.shutdown(0.0)
    thread.join(30.0)
    assert ended == ["ClosedError"], ended
    assert not bool((tensor[0, 3] == 0xAB).all()), "layer 3 landed: the test proves nothing"


@pytest.mark.parametrize("timeout", [0.2, 5.0])
def test_a_wait_layer_whose_layer_landed_returns_though_a_shutdown_came_meanwhile(timeout: float) -> None:
    """The layer landed, then another thread's shutdown closed the worker before the wait looked
    again (as a session's close that landed every load does while its forward waits): the wait
    returns (it raised ``ClosedError`` for a layer that had landed: found by a review)."""
    tensor = torch.zeros(4, 4, 64, dtype=torch.uint8)
    w = Worker.create(DeviceLayout.from_tensors([tensor], block_dim=0, layer_dim=1), 4, backend="host")
    w.host_records()[2].fill_(0xAB)
    load = w.load_by_layer(1, [2], [0])
    marks = load._marks  # noqa: SLF001 - the race, made to happen
    wait = marks.wait

    def then_shut_down(layer: int, stream: object | None, timeout_s: float) -> bool:
        landed = wait(layer, stream, timeout_s)
        w.shutdown(10.0)
        return landed

    marks.wait = then_shut_down  # type: ignore[method-assign]
    load.wait_layer(3, timeout=timeout)
    assert w.closed and bool((tensor[0, 3] == 0xAB).all())


def test_a_long_wait_layer_still_times_out_at_its_deadline_naming_it() -> None:
    def make(direction: Direction) -> FakeBackend:
        return FakeBackend(direction, auto_finish=False)

    with Worker.create(cache("per-layer"), HOST_BLOCKS, backend_factory=make) as w:
        load = w.load_by_layer(1, [0, 1], [2, 3])
        start = time.monotonic()
        with pytest.raises(WaitTimeoutError, match=r"did not finish within 0\.6 s"):
            load.wait_layer(0, timeout=0.6)
        assert time.monotonic() - start >= 0.6
        with contextlib.suppress(KVOffloadError):
            w.shutdown(timeout=0.1)


def test_waits_racing_the_jobs_completion_all_return() -> None:
    """Threads waiting for every layer while the job completes and its marks are released: none
    hangs or raises (the marks go back once, under their lock)."""
    with Worker.create(cache("per-layer"), HOST_BLOCKS) as w:
        for job in range(20):
            load = w.load_by_layer(job, [0, 1, 2], [10, 11, 12])
            errors: list[BaseException] = []

            def waiter(layer: int, load: LayerLoad = load) -> None:
                try:
                    load.wait_layer(layer, timeout=TIMEOUT_S)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=waiter, args=(i % LAYERS,)) for i in range(6)]
            for t in threads:
                t.start()
            assert all(r.ok for r in w.wait([job], TIMEOUT_S))
            for t in threads:
                t.join(TIMEOUT_S)
            assert not errors and not any(t.is_alive() for t in threads)


class IssuedHere(HostBackend):
    """A host backend whose jobs may be issued on the caller's thread; records each layered issue
    as (thread, first layer, layers)."""

    def __init__(self, direction: Direction) -> None:
        super().__init__(direction)
        self.calls: list[tuple[int, int, int]] = []

    def can_issue_here(self) -> bool:
        return True

    def issue_layers(self, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array,
                     fence: object, marks: LayerMarks, first: int = 0) -> HostTicket:
        self.calls.append((threading.get_ident(), first, len(plans)))
        return super().issue_layers(plans, src, dst, fence, marks, first)


def test_layer_0_is_issued_on_the_callers_thread_and_the_rest_on_the_issuer() -> None:
    backends: list[IssuedHere] = []

    def make(direction: Direction) -> IssuedHere:
        backends.append(IssuedHere(direction))
        return backends[-1]

    layout = cache("per-layer", seed=9)
    with Worker.create(layout, HOST_BLOCKS, backend_factory=make) as w:
        w.store(1, [1, 2], [3, 4])
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
        load = w.load_by_layer(2, [3, 4], [10, 11])
        load.wait_layer(0, timeout=0.0)  # copied before the call returned: no wait at all
        for layer in range(1, LAYERS):
            load.wait_layer(layer)
        (result,) = w.wait([2], TIMEOUT_S)
        assert result.ok and result.nbytes == 2 * layout.block_bytes
        assert w.poll() == []  # one result for the job, never one per part
        (head, rest) = backends[1].calls
        assert head == (threading.get_ident(), 0, 1)
        assert rest[0] != threading.get_ident() and rest[1:] == (1, LAYERS - 1)
    assert torch.equal(layout.gather_records([10, 11]), layout.gather_records([1, 2]))
