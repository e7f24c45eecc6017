"""A host pool shared by tensor-parallel ranks (docs/design.md §13), in one process: each rank is a
thread with a Worker of its own and its own mapping of the pool, over the host backend. The copy
plans of every path address only a rank's slices; two ranks never write the same bytes (with a
control that shows the hazard when a rank ignores the pool's stride); the attach's rules (deadline,
agreement on the geometry, stale files replaced, collisions refused, a failing rank failing all);
one rank's shutdown leaving the others alone; the disk tier over a rank's slices. The same rules
with real processes (kill -9 among them) are in ``test_shared_pool_processes.py``."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import (
    ArgumentTypeError,
    DeviceLayout,
    DiskConfig,
    InvalidArgumentError,
    KVOffloadError,
    PoolCollisionError,
    PoolMismatchError,
    PoolRankFailedError,
    PoolTimeoutError,
    PoolRank,
    RegionError,
    RemoteConfig,
    SharedPool,
    Worker,
)
from kvoffload._descriptors import CopyPlan, PageTable, kernel_segments, plan_staged, plan_staged_part
from kvoffload.backends.host import HostBackend
from kvoffload.cli.demo import build_cache
from kvoffload.errors import ClosedError
from kvoffload.handler import Backend
from kvoffload.pool import header as pool_header
from kvoffload.records import Direction
from kvoffload.region import SHM_DIR
from kvoffload.testing import MemoryCluster, check_worker_contract
from tests.unit.test_region import RecordingPinner
from tests.unit.test_staged_plan import SLOT_BASES, byte_map, plan_for

I64 = npt.NDArray[np.int64]
T = TypeVar("T")
TIMEOUT_S = 30.0
#: The deadline of attaches that are meant to time out.
SHORT_S = 0.5
HOST_BLOCKS = 12
PATTERN = 0xA5


def cache(seed: int, *, head_dim: int = 32, kind: str = "per-layer") -> DeviceLayout:
    tensors, block_dim = build_cache(
        kind, num_blocks=24, layers=2, kv_heads=2, head_dim=head_dim, block_size=4,
        dtype=torch.bfloat16, device=torch.device("cpu"), seed=seed,
    )
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim)


@pytest.fixture
def name() -> Iterator[str]:
    """A fresh pool name; the test fails if anything is left under it in /dev/shm."""
    pool_name = f"kvoffload-test-{uuid.uuid4().hex}"
    yield pool_name
    path = os.path.join(SHM_DIR, pool_name)
    if os.path.exists(path):
        os.unlink(path)
        pytest.fail(f"{path} was left behind")


def attach_all(
    pool: SharedPool, ranks: list[int], make: Callable[[int], T]
) -> dict[int, T | BaseException]:
    """``make(r)`` for every rank at once, one thread each; what each returned or raised."""
    out: dict[int, T | BaseException] = {}

    def run(r: int) -> None:
        try:
            out[r] = make(r)
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(pool.attach_timeout_s + TIMEOUT_S)
    assert len(out) == len(ranks), "an attach did not return"
    return out


def shut(made: dict[int, Worker | BaseException]) -> None:
    """Shut down the workers among ``made`` (a test that expected errors got one anyway)."""
    for w in made.values():
        if isinstance(w, Worker):
            w.shutdown()


def failures(
    pool: SharedPool, ranks: list[int], make: Callable[[int], Worker]
) -> dict[int, BaseException]:
    """``attach_all`` where every rank must fail: what each raised (a worker made anyway is shut
    down and fails the test)."""
    made = attach_all(pool, ranks, make)
    shut(made)
    errors = {r: e for r, e in made.items() if isinstance(e, BaseException)}
    assert len(errors) == len(ranks), f"ranks {sorted(set(made) - set(errors))} attached: {errors}"
    return errors


@contextmanager
def workers(
    pool: SharedPool, layouts: dict[int, DeviceLayout], **kwargs: Any
) -> Iterator[dict[int, Worker]]:
    """A worker per rank of ``layouts`` over ``pool``, shut down at the end."""
    made = attach_all(pool, sorted(layouts),
                      lambda r: Worker.create(layouts[r], HOST_BLOCKS, shared=pool.rank(r), **kwargs))
    ready = {r: w for r, w in made.items() if isinstance(w, Worker)}
    try:
        failed = [e for e in made.values() if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        yield ready
    finally:
        for w in ready.values():
            w.shutdown()


def traffic(w: Worker, layout: DeviceLayout, seed: int, rounds: int, *, verify: bool = True) -> None:
    """Rounds of store then load of random records through random host blocks, each checked."""
    rng = np.random.default_rng(seed)
    half = layout.num_blocks // 2
    for i in range(rounds):
        n = int(rng.integers(1, 7))
        src = rng.choice(half, n, replace=False)
        dst = half + rng.choice(half, n, replace=False)
        host = rng.choice(w.num_host_blocks, n, replace=False)
        layout.scatter_records(src, torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8))
        expected = layout.gather_records(src)
        w.store(2 * i, src, host)
        assert w.wait([2 * i], TIMEOUT_S)[0].ok
        if verify:
            assert torch.equal(w.host_records()[torch.as_tensor(host)], expected)
        w.load(2 * i + 1, host, dst)
        assert w.wait([2 * i + 1], TIMEOUT_S)[0].ok
        if verify:
            assert torch.equal(layout.gather_records(dst), expected)


# ------------------------------------------------------------------------------- the copy plans


def strided_plan(direction: Direction, pages: list[int], stride_records: int, rank: int) -> CopyPlan:
    plan = plan_for(direction, pages)
    record = plan.pages.record_bytes
    return attrs.evolve(plan, host_base=plan.host_base + rank * record,
                        host_stride=stride_records * record)


def host_side(plan: CopyPlan, dsts: npt.NDArray[np.uint64], srcs: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    return dsts if plan.direction is Direction.STORE else srcs


def assert_inside_own_slices(plan: CopyPlan, starts: npt.NDArray[np.uint64], sizes: npt.NDArray[np.uint64]) -> None:
    """Every host range lies inside one record of this rank: [base + b * stride, + record)
    (with one rank, the records are adjacent and runs may span several)."""
    if plan.host_stride == plan.pages.record_bytes:
        return
    offset = starts.astype(np.int64) - plan.host_base
    block = offset // plan.host_stride
    within = offset - block * plan.host_stride
    assert (within >= 0).all() and (within + sizes.astype(np.int64) <= plan.pages.record_bytes).all()


strided_jobs = st.tuples(
    st.sampled_from([Direction.STORE, Direction.LOAD]),
    st.lists(st.sampled_from([16, 100, 512, 1024]), min_size=1, max_size=3),
    st.lists(st.integers(0, 40), min_size=1, max_size=16, unique=True),
    st.integers(1, 8),
    st.data(),
)


@settings(max_examples=100, deadline=None)
@given(strided_jobs)
def test_every_path_addresses_only_this_ranks_slices(
    job: tuple[Direction, list[int], list[int], int, st.DataObject],
) -> None:
    direction, pages, ids, world, data = job
    rank = data.draw(st.integers(0, world - 1))
    plan = strided_plan(direction, pages, world, rank)
    device = np.array(ids, dtype=np.int64)
    host = np.array(data.draw(st.permutations(ids)), dtype=np.int64)
    src, dst = (device, host) if direction is Direction.STORE else (host, device)
    # dma and host paths: the plan's descriptors, against a brute-force reference
    built = plan.build(src, dst)
    reference: dict[int, int] = {}
    for d, h in zip(device.tolist(), host.tolist()):
        for p in range(plan.pages.num_pages):
            dev = int(plan.pages.dev_base[p] + d * plan.pages.dev_stride[p])
            hst = plan.host_base + h * plan.host_stride + int(plan.pages.host_offset[p])
            s, t = (dev, hst) if direction is Direction.STORE else (hst, dev)
            for k in range(0, int(plan.pages.nbytes[p]), 4):
                reference[t + k] = s + k
    assert byte_map(built.dsts, built.srcs, built.sizes) == reference
    assert_inside_own_slices(plan, host_side(plan, built.dsts, built.srcs), built.sizes)
    # staged: record copies between a slot and the pool stay in this rank's slices
    for chunk in plan_staged(plan, src, dst, SLOT_BASES, data.draw(st.integers(1, 6))):
        assert_inside_own_slices(plan, host_side(plan, chunk.dma.dsts, chunk.dma.srcs), chunk.dma.sizes)
    # staged, one layer's pages (a layered load): the DMA moves only those ranges of this rank's
    # slices, exactly the reference's host bytes of those pages
    keep = np.array(sorted(data.draw(st.lists(st.integers(0, plan.pages.num_pages - 1), min_size=1,
                                               unique=True))), dtype=np.int64)
    pages_all = plan.pages
    layer = plan.for_pages(PageTable(dev_base=pages_all.dev_base[keep], dev_stride=pages_all.dev_stride[keep],
                                     nbytes=pages_all.nbytes[keep], host_offset=pages_all.host_offset[keep],
                                     segment=pages_all.segment[keep], record_bytes=pages_all.record_bytes))
    expected_host = {
        plan.host_base + h * plan.host_stride + int(pages_all.host_offset[k]) + b
        for h in host.tolist() for k in keep.tolist() for b in range(0, int(pages_all.nbytes[k]), 4)
    }
    moved_host: set[int] = set()
    for chunk in plan_staged_part(layer, src, dst, SLOT_BASES, 6 * pages_all.record_bytes):
        starts = host_side(layer, chunk.dma.dsts, chunk.dma.srcs)
        assert_inside_own_slices(layer, starts, chunk.dma.sizes)
        for start, size in zip(starts.tolist(), chunk.dma.sizes.tolist()):
            moved_host.update(range(int(start), int(start) + int(size), 4))
    assert moved_host == expected_host
    # sm: the kernel's table, expanded with the plan's stride (as SmPath launches it)
    table = kernel_segments(plan.pages)
    kernel: dict[int, int] = {}
    for d, h in zip(device.tolist(), host.tolist()):
        for dev_base, dev_stride, offset, nbytes in table.tolist():
            dev, hst = dev_base + d * dev_stride, plan.host_base + h * plan.host_stride + offset
            s, t = (dev, hst) if direction is Direction.STORE else (hst, dev)
            kernel.update({t + k: s + k for k in range(0, nbytes, 4)})
    assert kernel == reference


def test_consecutive_records_of_a_rank_never_merge_into_one_copy() -> None:
    # A record with no padding whose pages are one allocation: alone, consecutive records merge.
    alone = plan_for(Direction.STORE, [4096], block_major=True)
    shared = attrs.evolve(alone, host_stride=2 * 4096)
    ids = np.arange(4, dtype=np.int64)
    assert alone.build(ids, ids).count == 1
    assert shared.build(ids, ids).count == 4
    (chunk,) = plan_staged(shared, ids, ids, SLOT_BASES, 8)
    assert chunk.dma.count == 4 and chunk.dma.sizes.tolist() == [4096] * 4


def test_a_stride_shorter_than_a_record_is_refused() -> None:
    with pytest.raises(ValueError, match="less than a record"):
        attrs.evolve(plan_for(Direction.STORE, [1024]), host_stride=2048)


# --------------------------------------------------------------------------------- the arguments


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: SharedPool("../x", 2), InvalidArgumentError, r"name = '\.\./x' must be 1-200"),
        (lambda: SharedPool("", 2), InvalidArgumentError, "name = '' must be"),
        (lambda: SharedPool("x", 0), InvalidArgumentError, "world_size = 0 must be between 1 and 64"),
        (lambda: SharedPool("x", 65), InvalidArgumentError, "world_size = 65 must be between 1 and 64"),
        (lambda: SharedPool("x", True), ArgumentTypeError, "world_size = True must be an int"),
        (lambda: SharedPool("x", 2, generation=-1), InvalidArgumentError, "generation = -1 must be"),
        (lambda: SharedPool("x", 2, attach_timeout_s=0), InvalidArgumentError, "attach_timeout_s = 0"),
        (lambda: SharedPool("x", 2, launch=5), ArgumentTypeError,  # type: ignore[arg-type]
         "launch = 5 must be a str or None, not a int"),
        (lambda: SharedPool("x", 2, launch=""), InvalidArgumentError, "launch must be 1-256 characters"),
        (lambda: SharedPool("x", 2, launch="x" * 257), InvalidArgumentError, "not 257"),
        (lambda: SharedPool("x", 2, attach_timeout_s=float("nan")), InvalidArgumentError, "finite"),
        (lambda: SharedPool("x", 2, attach_timeout_s=10**400), InvalidArgumentError, "finite"),
        (lambda: SharedPool.inspect("x", pid="1"),  # type: ignore[arg-type]
         ArgumentTypeError, "pid = '1' must be an int"),
        (lambda: SharedPool.inspect("x", pid=True), ArgumentTypeError, "pid = True must be an int"),
        (lambda: SharedPool.inspect("x", pid=0), InvalidArgumentError, "pid = 0 must be between 1"),
        (lambda: SharedPool.inspect("x", writable="yes"),  # type: ignore[arg-type]
         ArgumentTypeError, "writable = 'yes' must be a bool"),
        (lambda: SharedPool("x", 2, attach_timeout_s="5"),  # type: ignore[arg-type]
         ArgumentTypeError, "number of seconds"),
        (lambda: SharedPool("x", 2).rank(2), InvalidArgumentError, "rank = 2 must be between 0 and 1"),
        (lambda: SharedPool("x", 2).rank(-1), InvalidArgumentError, "rank = -1 must be between 0 and 1"),
        (lambda: SharedPool("x", 2).rank(1.0), ArgumentTypeError,  # type: ignore[arg-type]
         "rank = 1.0 must be an int"),
        # a rank built by hand is checked too (-1 took the last rank's place in the pool's header)
        (lambda: PoolRank(SharedPool("x", 2), -1), InvalidArgumentError, "rank = -1 must be between 0 and 1"),
        (lambda: PoolRank(SharedPool("x", 2), 5), InvalidArgumentError, "rank = 5 must be between 0 and 1"),
        (lambda: PoolRank(SharedPool("x", 2), "0"), ArgumentTypeError,  # type: ignore[arg-type]
         "rank = '0' must be an int"),
        (lambda: PoolRank("x", 0), ArgumentTypeError, "pool must be a SharedPool, got str"),  # type: ignore[arg-type]
    ],
)
def test_bad_pool_arguments_are_refused(make: Callable[[], object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_worker_refuses_a_bad_shared_argument_before_mapping_anything(name: str) -> None:
    layout = cache(0)
    with pytest.raises(ArgumentTypeError, match="shared must be a PoolRank"):
        Worker.create(layout, 4, shared=name)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="shared or shared_name, not both"):
        Worker.create(layout, 4, shared=SharedPool(name, 1).rank(0), shared_name=name)
    cluster = MemoryCluster()  # a remote tier needs a pool of the worker's own
    with pytest.raises(InvalidArgumentError, match="remote tier over a pool shared by 2 ranks"):
        Worker.create(layout, 4, shared=SharedPool(name, 2).rank(0),
                      remote=RemoteConfig(store=cluster.factory))
    assert not os.path.exists(f"/dev/shm/{name}")


# ------------------------------------------------------------------ rule 5: ranks never collide


class NaiveBackend(HostBackend):
    """A rank that ignores the pool's stride: host record b at its base + b * record_bytes, as if
    the pool were its own (the hazard rule 5 rules out)."""

    def issue(self, plan: CopyPlan, src: I64, dst: I64, fence: object) -> Any:
        return super().issue(attrs.evolve(plan, host_stride=plan.pages.record_bytes), src, dst, fence)


def patterned_traffic(name: str, factory: Callable[[Direction], Backend] | None, verify: bool) -> bool:
    """Ranks 0 and 1 of a 3-rank pool move data at once (rank 1 over ``factory``'s backend) while
    rank 2's slices hold a pattern; whether the pattern survived."""
    pool = SharedPool(name, 3, attach_timeout_s=TIMEOUT_S)
    layouts = {r: cache(r) for r in range(3)}
    made = attach_all(pool, [0, 1, 2], lambda r: Worker.create(
        layouts[r], HOST_BLOCKS, shared=pool.rank(r),
        backend_factory=factory if r == 1 else None))
    ws = {r: w for r, w in made.items() if isinstance(w, Worker)}
    try:
        assert len(ws) == 3, made
        with SharedPool.inspect(name, pid=os.getpid(), writable=True) as view:
            blocks = view.blocks()
            blocks[:, 2] = PATTERN
            runs = attach_all(pool, [0, 1], lambda r: traffic(ws[r], layouts[r], seed=r, rounds=30,
                                                               verify=verify))
            errors = [e for e in runs.values() if isinstance(e, BaseException)]
            if errors:
                raise errors[0]
            intact = bool((blocks[:, 2] == PATTERN).all())
            del blocks
        return intact
    finally:
        for w in ws.values():
            w.shutdown()


def test_a_ranks_copies_never_touch_another_ranks_slices(name: str) -> None:
    assert patterned_traffic(name, None, verify=True)


def test_control_a_rank_ignoring_the_stride_overwrites_another_ranks_slices(name: str) -> None:
    assert not patterned_traffic(name, NaiveBackend, verify=False)


def test_ranks_with_their_own_data_in_one_host_block_read_back_their_own(name: str) -> None:
    pool = SharedPool(name, 3, attach_timeout_s=TIMEOUT_S)
    layouts = {r: cache(10 + r) for r in range(3)}
    with workers(pool, layouts) as ws:
        for r, w in ws.items():
            w.store(1, [0, 1, 2], [4, 5, 11])  # the same host blocks on every rank
        for r, w in ws.items():
            assert w.wait([1], TIMEOUT_S)[0].ok
        with SharedPool.inspect(name, pid=os.getpid()) as view:
            blocks = view.blocks()
            assert view.info.state == "ready" and not view.info.linked
            for r, w in ws.items():
                expected = layouts[r].gather_records([0, 1, 2])
                assert torch.equal(w.host_records()[[4, 5, 11]], expected)
                assert np.array_equal(blocks[[4, 5, 11], r], expected.numpy())
            del blocks
        for r, w in ws.items():
            layouts[r].scatter_records([20, 21, 22], torch.zeros(3, layouts[r].record_bytes, dtype=torch.uint8))
            w.load(2, [4, 5, 11], [20, 21, 22])
            assert w.wait([2], TIMEOUT_S)[0].ok
            assert torch.equal(layouts[r].gather_records([20, 21, 22]), layouts[r].gather_records([0, 1, 2]))


def test_the_disk_tier_of_each_rank_moves_only_its_own_slices(name: str, tmp_path: Any) -> None:
    pool = SharedPool(name, 3, attach_timeout_s=TIMEOUT_S)
    layouts = {r: cache(20 + r) for r in range(3)}
    made = attach_all(pool, [0, 1, 2], lambda r: Worker.create(
        layouts[r], HOST_BLOCKS, shared=pool.rank(r), bounce_slots=4,
        disk=DiskConfig(str(tmp_path / f"rank{r}.bin"), num_blocks=16)))
    ws = {r: w for r, w in made.items() if isinstance(w, Worker)}
    try:
        assert len(ws) == 3, made
        with SharedPool.inspect(name, pid=os.getpid(), writable=True) as view:
            blocks = view.blocks()
            assert blocks.shape[0] == HOST_BLOCKS + 4  # the bounce slots are blocks of the pool
            blocks[:, 2] = PATTERN

            def disk_round_trips(r: int) -> None:
                w, layout = ws[r], layouts[r]
                expected = layout.gather_records([0, 1, 2, 3])
                w.store(1, [0, 1, 2, 3], [0, 1, 2, 3])
                assert w.wait([1], TIMEOUT_S)[0].ok
                w.demote(2, [0, 1, 2, 3], [4, 5, 6, 7])
                assert w.wait([2], TIMEOUT_S)[0].ok
                w.promote(3, [4, 5, 6, 7], [8, 9, 10, 11])
                w.store_to_disk(4, [0, 1, 2, 3], [0, 1, 2, 3])
                assert [x.ok for x in w.wait([3, 4], TIMEOUT_S)] == [True, True]
                assert torch.equal(w.host_records()[8:12], expected)
                w.load_from_disk(5, [0, 1, 2, 3], [12, 13, 14, 15])
                assert w.wait([5], TIMEOUT_S)[0].ok
                assert torch.equal(layout.gather_records([12, 13, 14, 15]), expected)

            runs = attach_all(pool, [0, 1], disk_round_trips)
            errors = [e for e in runs.values() if isinstance(e, BaseException)]
            if errors:
                raise errors[0]
            assert bool((blocks[:, 2] == PATTERN).all())
            del blocks
    finally:
        for w in ws.values():
            w.shutdown()


# ------------------------------------------------------------------------- rule 4: ownership


def test_a_rank_keeps_the_worker_contract_after_the_other_rank_left() -> None:
    def make() -> Worker:
        """Rank 0 of a fresh 2-rank pool whose rank 1 attaches and shuts down at once."""
        pool = SharedPool(f"kvoffload-test-{uuid.uuid4().hex}", 2, attach_timeout_s=TIMEOUT_S)
        made = attach_all(pool, [0, 1], lambda r: Worker.create(cache(r), HOST_BLOCKS, shared=pool.rank(r)))
        other, worker = made[1], made[0]
        assert isinstance(other, Worker) and isinstance(worker, Worker), made
        other.shutdown()
        return worker

    check_worker_contract(make)


def test_one_ranks_shutdown_leaves_the_others_mapping_registration_and_data_alone(name: str) -> None:
    pool = SharedPool(name, 2, attach_timeout_s=TIMEOUT_S)
    layouts = {r: cache(30 + r) for r in range(2)}
    pinners = {r: RecordingPinner() for r in range(2)}
    made = attach_all(pool, [0, 1], lambda r: Worker.create(layouts[r], HOST_BLOCKS,
                                                            shared=pool.rank(r), pinner=pinners[r]))
    w0, w1 = made[0], made[1]
    assert isinstance(w0, Worker) and isinstance(w1, Worker)
    try:
        for w in (w0, w1):
            w.store(1, [0, 1], [3, 4])
            assert w.wait([1], TIMEOUT_S)[0].ok
        registered = dict(pinners[0].registered)
        w1.shutdown()
        assert pinners[1].registered == {} and pinners[0].registered == registered != {}
        with SharedPool.inspect(name, pid=os.getpid()) as view:
            assert [(i.rank, i.left) for i in view.info.ranks] == [(0, False), (1, True)]
            assert np.array_equal(view.blocks()[[3, 4], 1], layouts[1].gather_records([0, 1]).numpy())
        assert torch.equal(w0.host_records()[[3, 4]], layouts[0].gather_records([0, 1]))
        traffic(w0, layouts[0], seed=3, rounds=10)
    finally:
        w0.shutdown()
        w1.shutdown()


# ---------------------------------------------------------------------- rule 1: the deadline


def test_a_missing_rank_fails_every_rank_that_arrived_naming_it(name: str) -> None:
    pool = SharedPool(name, 3, attach_timeout_s=SHORT_S)
    made = failures(pool, [0, 1], lambda r: Worker.create(cache(r), HOST_BLOCKS, shared=pool.rank(r)))
    for r in (0, 1):
        error = made[r]
        assert isinstance(error, PoolTimeoutError), error
        assert error.ranks == (2,) and error.pool == name
        assert "rank(s) 2 of 3 did not arrive" in str(error)
    # the name is free again: a complete set of ranks attaches under it
    full = SharedPool(name, 1)
    with Worker.create(cache(0), HOST_BLOCKS, shared=full.rank(0)):
        pass


def test_ranks_that_disagree_on_the_record_size_all_fail_naming_the_ranks(name: str) -> None:
    pool = SharedPool(name, 3, attach_timeout_s=TIMEOUT_S)
    layouts = {0: cache(0), 1: cache(1, head_dim=128), 2: cache(2)}
    assert layouts[1].record_bytes != layouts[0].record_bytes
    made = failures(pool, [0, 1, 2], lambda r: Worker.create(layouts[r], HOST_BLOCKS, shared=pool.rank(r)))
    for r in range(3):
        error = made[r]
        assert isinstance(error, PoolMismatchError), error
        assert error.ranks == (1,)
        assert (f"record_bytes {layouts[0].record_bytes}, num_records {HOST_BLOCKS} on rank(s) 0, 2; "
                f"record_bytes {layouts[1].record_bytes}, num_records {HOST_BLOCKS} on rank(s) 1") in str(error)


def test_ranks_that_disagree_on_the_block_count_all_fail(name: str) -> None:
    pool = SharedPool(name, 2, attach_timeout_s=TIMEOUT_S)
    made = failures(pool, [0, 1], lambda r: Worker.create(cache(r), HOST_BLOCKS + r, shared=pool.rank(r)))
    assert all(isinstance(e, PoolMismatchError) and e.ranks == (1,) for e in made.values()), made


def test_a_rank_that_fails_after_joining_fails_every_rank(name: str) -> None:
    pool = SharedPool(name, 2, attach_timeout_s=TIMEOUT_S)
    made = failures(pool, [0, 1], lambda r: Worker.create(
        cache(r), HOST_BLOCKS, shared=pool.rank(r),
        pinner=RecordingPinner(fail_register_at=0 if r == 1 else None)))
    assert isinstance(made[1], KVOffloadError) and "injected" in str(made[1])
    error = made[0]
    assert isinstance(error, PoolRankFailedError) and error.ranks == (1,), error
    assert "gave up" in str(error)


# ------------------------------------------------------------- rule 3: stale files, collisions


def attach_in_background(
    pool: SharedPool, rank: int
) -> tuple[dict[int, Worker | BaseException], threading.Thread]:
    """Rank ``rank`` attaching in a thread; returns once its pool file exists."""
    made: dict[int, Worker | BaseException] = {}
    thread = threading.Thread(target=lambda: made.update(attach_all(
        pool, [rank], lambda r: Worker.create(cache(r), HOST_BLOCKS, shared=pool.rank(r)))))
    thread.start()
    path = os.path.join(SHM_DIR, pool.name)
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    return made, thread


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def plant(name: str, *, generation: int, pid: int, start: int, world: int = 2,
          launch: bytes = pool_header.NO_LAUNCH) -> str:
    """A pool file under ``name`` whose rank 0 is the process ``(pid, start)``."""
    path = os.path.join(SHM_DIR, name)
    slot = pool_header.Slot(pid, pool_header.Flag.ARRIVED, start, 7, 4096, 4)
    header = pool_header.new_header(world, generation, time.time_ns(), launch).with_slot(0, slot)
    with open(path, "wb") as f:
        f.write(header.encode())
    return path


@pytest.mark.parametrize("generation", [0, 9])
def test_a_stale_file_of_a_dead_creator_is_replaced(name: str, generation: int) -> None:
    plant(name, generation=generation, pid=dead_pid(), start=1)
    pool = SharedPool(name, 2, attach_timeout_s=TIMEOUT_S)
    with workers(pool, {0: cache(0), 1: cache(1)}) as ws:
        traffic(ws[1], ws[1].layout, seed=1, rounds=3)


@pytest.mark.parametrize("theirs", ["run-1", "run-2", None], ids=["same launch", "another launch", "none"])
def test_a_stale_file_of_any_launch_is_replaced(name: str, theirs: str | None) -> None:
    """(A restart after a crash may reuse its token, e.g. a job id: its crashed attempt's file, its
    ranks dead, is replaced as any stale file, not taken for this attempt's.)"""
    launch = SharedPool(name, 2, launch=theirs).launch_digest
    plant(name, generation=0, pid=dead_pid(), start=1, launch=launch)
    with workers(SharedPool(name, 2, launch="run-1", attach_timeout_s=TIMEOUT_S), {0: cache(0), 1: cache(1)}) as ws:
        traffic(ws[1], ws[1].layout, seed=1, rounds=2)


@pytest.mark.parametrize("case", ["rank lost", "failed", "control: no launch"])
def test_a_late_rank_of_a_launch_whose_attach_failed_gets_its_error_at_once(name: str, case: str) -> None:
    """Rank 0 of the launch still runs (this process), rank 1 died (or the attach was marked failed
    on a mismatch): rank 2 of the same launch fails at once with that attach's error, as rank 0
    does, instead of replacing the file and waiting in a pool of its own until its deadline (the
    control, without a launch, does that)."""
    launch = None if case.startswith("control") else "run-1"
    me = os.getpid()
    start = pool_header.process_start(me)
    assert start is not None
    live = pool_header.Slot(me, pool_header.Flag.ARRIVED, start, 7, 4096, 4)
    dead = pool_header.Slot(dead_pid(), pool_header.Flag.ARRIVED, 1, 8, 4096, 4)
    header = pool_header.new_header(3, 0, time.time_ns(), SharedPool(name, 3, launch=launch).launch_digest)
    header = header.with_slot(0, live).with_slot(1, dead if case != "failed" else live)
    if case == "failed":
        header = header.replace(state=pool_header.State.FAILED, failure=pool_header.Failure.MISMATCH,
                                failed=0b11)
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(header.encode())
    pool = SharedPool(name, 3, launch=launch, attach_timeout_s=1.0 if launch is None else TIMEOUT_S)
    began = time.monotonic()
    expected = {"rank lost": (PoolRankFailedError, r"rank\(s\) 1 \(pid .*\) died"),
                "failed": (PoolMismatchError, "disagree on its geometry"),
                "control: no launch": (PoolTimeoutError, r"rank\(s\) 0, 1 of 3 did not arrive")}[case]
    with pytest.raises(expected[0], match=expected[1]):
        Worker.create(cache(0), HOST_BLOCKS, shared=pool.rank(2))
    if launch is not None:
        assert time.monotonic() - began < TIMEOUT_S / 2
    assert not os.path.exists(path)


def test_a_live_file_of_another_launch_or_none_is_a_collision_and_left_alone(name: str) -> None:
    me = os.getpid()
    start = pool_header.process_start(me)
    assert start is not None
    for theirs, ours, said in [("a", "b", "named another launch than this rank's"),
                               (None, "b", "named no launch; this rank names one"),
                               ("a", None, "named a launch; this rank names none")]:
        path = plant(name, generation=0, pid=me, start=start, launch=SharedPool(name, 2, launch=theirs).launch_digest)
        with open(path, "rb") as f:
            planted = f.read()
        pool = SharedPool(name, 2, launch=ours, attach_timeout_s=TIMEOUT_S)
        with pytest.raises(PoolCollisionError, match=f"held by another launch of an engine .*{said}") as caught:
            Worker.create(cache(1), HOST_BLOCKS, shared=pool.rank(1))
        assert caught.value.ranks == (0,) and caught.value.pids == (me,)
        with open(path, "rb") as f:
            assert f.read() == planted  # left alone
        os.unlink(path)


def _version_1(page: bytes) -> bytes:
    """``page`` as the library wrote it before the launch's digest: version 1, zeros after the head."""
    out = bytearray(page)
    out[8:12] = (1).to_bytes(4, "little")
    out[72:88] = bytes(16)
    return bytes(out)


def test_a_version_1_file_is_replaced_when_stale_and_refused_while_its_ranks_live(name: str) -> None:
    me = os.getpid()
    start = pool_header.process_start(me)
    assert start is not None
    path = plant(name, generation=0, pid=me, start=start)
    with open(path, "rb") as f:
        page = _version_1(f.read())
    with open(path, "wb") as f:
        f.write(page)
    with pytest.raises(PoolCollisionError, match="another kvoffload version .* version 1, this library's 2"):
        Worker.create(cache(1), HOST_BLOCKS, shared=SharedPool(name, 2, attach_timeout_s=TIMEOUT_S).rank(1))
    with open(path, "rb") as f:
        assert f.read() == page
    os.unlink(path)
    plant(name, generation=0, pid=dead_pid(), start=1)
    with open(path, "rb") as f:
        page = _version_1(f.read())
    with open(path, "wb") as f:
        f.write(page)
    with workers(SharedPool(name, 2, attach_timeout_s=TIMEOUT_S), {0: cache(0), 1: cache(1)}):
        pass


def test_a_header_written_without_a_launch_reads_as_none() -> None:
    header = pool_header.new_header(2, 0, 1)
    page = header.encode()
    assert header.launch == pool_header.NO_LAUNCH and page[72:128] == bytes(56)
    assert pool_header.decode(page) == header
    old = pool_header.decode(_version_1(page))
    assert old is not None and (old.version, old.launch) == (1, pool_header.NO_LAUNCH)
    assert old.replace(version=pool_header.VERSION) == header
    named = pool_header.new_header(2, 0, 1, SharedPool("x", 2, launch="a").launch_digest)
    assert pool_header.decode(named.encode()) == named


def test_a_file_of_a_reused_pid_is_stale_too(name: str) -> None:
    me = os.getpid()
    start = pool_header.process_start(me)
    assert start is not None
    plant(name, generation=0, pid=me, start=start + 1)  # this pid, another process's start time
    with workers(SharedPool(name, 2, attach_timeout_s=TIMEOUT_S), {0: cache(0), 1: cache(1)}):
        pass


def test_a_live_pool_of_another_generation_is_a_collision_and_left_alone(name: str) -> None:
    first = SharedPool(name, 2, generation=1, attach_timeout_s=1.0)
    waiting, thread = attach_in_background(first, 0)
    other = SharedPool(name, 2, generation=2, attach_timeout_s=TIMEOUT_S)
    with pytest.raises(PoolCollisionError, match="held by another live pool") as caught:
        Worker.create(cache(1), HOST_BLOCKS, shared=other.rank(1))
    assert caught.value.ranks == (0,) and caught.value.pids == (os.getpid(),)
    same = SharedPool(name, 2, generation=1, attach_timeout_s=TIMEOUT_S)
    with pytest.raises(PoolCollisionError, match="rank 0 of shared pool .* is already held"):
        Worker.create(cache(1), HOST_BLOCKS, shared=same.rank(0))
    thread.join(TIMEOUT_S)
    assert isinstance(waiting[0], PoolTimeoutError) and waiting[0].ranks == (1,)


def test_a_file_that_is_not_a_pool_is_a_collision_and_never_overwritten(name: str) -> None:
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"someone else's")
    try:
        with pytest.raises(PoolCollisionError, match="not a kvoffload shared pool"):
            Worker.create(cache(0), HOST_BLOCKS, shared=SharedPool(name, 1).rank(0))
        with open(path, "rb") as f:
            assert f.read() == b"someone else's"
        with pytest.raises(RegionError, match="not a kvoffload shared pool"):
            SharedPool.inspect(name)
    finally:
        os.unlink(path)


# ----------------------------------------------------------------------------------- inspect


def test_inspect_shows_an_attach_in_progress_and_then_the_mapped_pool(name: str) -> None:
    pool = SharedPool(name, 2, attach_timeout_s=TIMEOUT_S)
    made, thread = attach_in_background(pool, 1)
    path = os.path.join(SHM_DIR, name)
    with SharedPool.inspect(name) as view:
        info = view.info
        assert (info.linked, info.state, info.world_size, info.path) == (True, "joining", 2, path)
        assert [(i.arrived, i.alive, i.pid) for i in info.ranks] == [(False, False, 0), (True, True, os.getpid())]
        with pytest.raises(RegionError, match="no agreed geometry"):
            view.blocks()
    w0 = Worker.create(cache(0), HOST_BLOCKS, shared=pool.rank(0))
    thread.join(TIMEOUT_S)
    w1 = made[1]
    assert isinstance(w1, Worker)
    try:
        assert not os.path.exists(path)  # rule 2: unlinked once every rank mapped it
        view = SharedPool.inspect(name)
        info = view.info
        assert (info.linked, info.state, info.num_records, info.block_bytes) == (
            False, "ready", HOST_BLOCKS, 2 * w0.layout.record_bytes)
        assert all(i.mapped and i.populated and i.alive for i in info.ranks)
        view.close()
        view.close()
        with pytest.raises(ClosedError):
            view.blocks()
    finally:
        w0.shutdown()
        w1.shutdown()
    with pytest.raises(RegionError, match="holds none"):
        SharedPool.inspect(name, pid=os.getpid())


# ------------------------------------------------------------- the pool file's lock has a deadline


@contextmanager
def held_lock(path: str) -> Iterator[None]:
    """The pool file's lock held by another open file description (as a rank stopped inside a
    header update holds it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_a_held_lock_ends_its_wait_at_the_deadline(name: str) -> None:
    path = plant(name, generation=1, pid=os.getpid(), start=0, world=1)
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            with held_lock(path):
                began = time.monotonic()
                with pytest.raises(pool_header.LockTimeout):
                    with pool_header.locked(fd, deadline=began + 0.2):
                        pass
                assert 0.2 <= time.monotonic() - began < 5.0
            with pool_header.locked(fd, deadline=time.monotonic()):  # free: taken at once
                pass
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def test_an_attach_whose_pool_file_lock_stays_held_times_out(name: str) -> None:
    """A rank stopped inside a header update held the lock: the other ranks' attach ends at its
    deadline (and the grace), with PoolTimeoutError, instead of waiting for the lock."""
    pool = SharedPool(name, 2, attach_timeout_s=SHORT_S)
    made, thread = attach_in_background(pool, 0)
    path = os.path.join(SHM_DIR, name)
    with held_lock(path):
        began = time.monotonic()
        thread.join(TIMEOUT_S)
        took = time.monotonic() - began
    assert not thread.is_alive()
    error = made[0]
    assert isinstance(error, PoolTimeoutError), error
    assert "lock stayed held by another process" in str(error)
    assert took < 5.0  # the deadline, not the lock's holder, ended it
    os.unlink(path)  # left as it was: the rank could not write the header to mark it failed


def test_a_shutdown_does_not_wait_for_a_held_pool_file_lock(name: str) -> None:
    pool = SharedPool(name, 1, attach_timeout_s=TIMEOUT_S)
    w = Worker.create(cache(0), HOST_BLOCKS, shared=pool.rank(0))
    fd = w._region._fd  # the name is gone once every rank mapped the pool; the file is not
    assert fd is not None
    with held_lock(f"/proc/self/fd/{fd}"):
        began = time.monotonic()
        w.shutdown(timeout=2.0)
        took = time.monotonic() - began
    assert took < 2.0  # it waited MARK_LEFT_WAIT_S for the mark, then logged it


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_name_that_is_not_a_regular_file_is_refused_without_blocking(name: str, kind: str) -> None:
    path = os.path.join(SHM_DIR, name)
    if kind == "directory":
        os.mkdir(path)
    else:
        os.mkfifo(path)
    try:
        with pytest.raises(RegionError, match="not a kvoffload shared pool|Is a directory"):
            SharedPool.inspect(name)  # a FIFO's open blocked here, a directory raised IsADirectoryError
        with pytest.raises(RegionError):  # PoolCollisionError for the FIFO (was ESPIPE's OSError)
            Worker.create(cache(0), HOST_BLOCKS, shared=SharedPool(name, 1, attach_timeout_s=SHORT_S).rank(0))
    finally:
        (os.rmdir if kind == "directory" else os.unlink)(path)


@pytest.mark.parametrize("under_lock", [True, False], ids=["rule", "control-unlocked"])
def test_an_unlink_never_removes_a_newer_pool_linked_under_the_name(
    name: str, under_lock: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 3's "never a newer pool's": between a rank's inode check and its unlink, another rank
    removes the name (under the old file's lock, as every unlinker does) and a new pool is linked.
    Under the lock that cannot happen in between; the control (the check and unlink without the
    lock) removes the new pool's name."""
    import fcntl

    from kvoffload.pool import session
    old = plant(name, generation=1, pid=os.getpid(), start=0, world=1)
    fd = os.open(old, os.O_RDWR)
    real_unlink = os.unlink
    replaced: list[int] = []

    def unlink_after_a_pause(path: str) -> None:  # the pause between the check and the unlink
        other = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other rank's lock of the old file
            real_unlink(path)
            replaced.append(os.stat(plant(name, generation=2, pid=os.getpid(), start=0, world=1)).st_ino)
        except BlockingIOError:
            pass
        finally:
            os.close(other)
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", unlink_after_a_pause)
    try:
        if under_lock:
            session._unlink_if_same_locked(old, fd)
        else:
            session._unlink_if_same(old, fd)
    finally:
        monkeypatch.setattr(os, "unlink", real_unlink)
        os.close(fd)
    if under_lock:
        assert replaced == [] and not os.path.exists(old)  # the old name went, nothing else
    else:
        assert replaced and not os.path.exists(old)  # the newer pool's name was removed: the hazard
