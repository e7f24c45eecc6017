"""Requests through vLLM's own scheduler and OffloadingConnector, with kvoffload as the spec.

Every test drives vLLM's real ``Scheduler`` and both connector roles through :class:`EngineRunner`,
whose forward pass checks, before computing a request's tokens, that every earlier token holds the
bytes computed for it: a block reloaded from the host pool with a single wrong byte fails the step.
"""

from __future__ import annotations

import pytest

from tests.integration.vllm.conftest import VLLM_REASON, RunnerFactory

pytest.importorskip("vllm", reason=VLLM_REASON)

from kvoffload import Direction  # noqa: E402
from kvoffload.integrations.vllm import VLLMTransferError  # noqa: E402
from tests.integration.vllm._runner import TOKEN_BYTES  # noqa: E402
from tests.integration.vllm.faulty_spec import FaultySpec, RecordingSpec  # noqa: E402

BLOCK = 16
RECORD = 2 * BLOCK * TOKEN_BYTES  # the host record of one GPU block: 2 layers' pages (4 KiB)
POOL = 64 << 20
FAULTY = "tests.integration.vllm.faulty_spec"


def prompt(seed: int, length: int) -> list[int]:
    """A prompt no other seed shares a block with."""
    return [3 + (seed * 131 + i * 31) % 500 for i in range(length)]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_reloaded_blocks_are_byte_identical_and_scheduler_counts_the_hit(
    make_runner: RunnerFactory, blocks_per_chunk: int
) -> None:
    runner = make_runner(blocks_per_chunk=blocks_per_chunk, host_bytes=POOL)
    tokens = prompt(1, 7 * BLOCK + 5)  # 7 full blocks and a partial one
    first = runner.run([tokens])
    assert first.connector_hits == 0
    stored_chunks = 7 // blocks_per_chunk
    assert runner.manager.stats().stores_completed == stored_chunks

    runner.drop_gpu_cache()  # no GPU prefix cache, every KV byte zeroed
    second = runner.run([tokens])

    expected = stored_chunks * blocks_per_chunk * BLOCK
    assert second.connector_hits == expected, "the scheduler did not count the offloaded prefix"
    assert second.verified_tokens == expected, "not every reloaded token was checked"
    stats = runner.manager.stats()
    assert stats.loads_completed == stored_chunks and stats.host.loading == 0


def test_unaligned_load_starts_inside_the_first_chunk(make_runner: RunnerFactory) -> None:
    RecordingSpec.configure()
    runner = make_runner(
        blocks_per_chunk=2, host_bytes=POOL, spec_name="RecordingSpec", spec_module_path=FAULTY
    )
    tokens = prompt(2, 6 * BLOCK + 3)
    runner.run([tokens])  # chunks (0,1), (2,3), (4,5) stored
    runner.drop_gpu_cache()
    runner.run([tokens[:BLOCK] + prompt(3, BLOCK + 3)])  # the GPU cache now holds block 0 only
    (engine,) = RecordingSpec.engines
    engine.submitted.clear()

    again = runner.run([tokens])

    assert again.connector_hits == 5 * BLOCK, "blocks 1-5 should come from the host pool"
    assert again.verified_tokens == 6 * BLOCK  # block 0 from the GPU cache, blocks 1-5 reloaded
    (load,) = [job for job in engine.submitted if job.direction is Direction.LOAD]
    assert len(load.device_blocks) == 5
    records = load.host_records
    assert records[0] % 2 == 1, "the load must skip the first record of chunk 0"
    assert all(r % 2 == 0 for r in records[1::2]), "later chunks start at their first record"
    assert records[2::2] == [r + 1 for r in records[1::2]], "a chunk's blocks are consecutive records"


def test_eviction_under_pressure_serves_only_resident_chunks_with_correct_bytes(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(blocks_per_chunk=1, host_bytes=4 * RECORD)  # room for 4 chunks
    prompts = [prompt(10 + i, 3 * BLOCK + 1) for i in range(3)]  # 3 chunks each, 9 in all
    for tokens in prompts:
        runner.run([tokens])
    stats = runner.manager.stats()
    assert stats.host.capacity == 4
    assert stats.host_evictions >= 5 and stats.host.ready == 4

    runner.drop_gpu_cache()
    last = runner.run([prompts[-1]])  # the most recent prompt's chunks survived
    assert last.connector_hits == 3 * BLOCK and last.verified_tokens == 3 * BLOCK
    runner.drop_gpu_cache()
    first = runner.run([prompts[0]])  # its chunks were evicted: recomputed, nothing loaded
    assert first.connector_hits == 0 and first.verified_tokens == 0


def test_reset_with_jobs_in_flight_fences_chunks_until_the_workers_report(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(blocks_per_chunk=1, host_bytes=3 * RECORD)  # room for 3 chunks
    tokens = prompt(20, 3 * BLOCK + 2)
    runner.add_request(tokens)
    for _ in range(10):  # until the finished request's stores are planned but not reported
        runner.step()
        if runner.manager.stats().host.pending:
            break
    manager = runner.manager
    assert manager.stats().host.pending == 3

    runner.reset_connector()

    stats = manager.stats()
    assert stats.host.fenced == 3 and stats.host.free == 0, "in-flight chunks must stay fenced"
    assert manager.unsettled_plans == 1
    assert manager.manager.prepare_store([b"another-key"]) is None, "a fenced chunk was handed out"
    runner.run_until_idle()  # the flushed jobs are reported, vLLM calls on_reset_flushed
    stats = manager.stats()
    assert manager.unsettled_plans == 0
    assert stats.host.fenced == 0 and stats.host.free == 3 and stats.host.ready == 0
    assert stats.stale_completions >= 1

    runner.drop_gpu_cache()
    again = runner.run([tokens])
    assert again.connector_hits == 0, "a key stored before the reset must not be served"
    runner.drop_gpu_cache()
    third = runner.run([tokens])
    assert third.connector_hits == 3 * BLOCK and third.verified_tokens == 3 * BLOCK


def test_failed_load_is_retried_and_the_request_gets_the_stored_bytes(
    make_runner: RunnerFactory,
) -> None:
    FaultySpec.configure(fail_loads={0})  # the first load attempt fails and scribbles its blocks
    runner = make_runner(
        blocks_per_chunk=2, host_bytes=POOL, spec_name="FaultySpec", spec_module_path=FAULTY
    )
    tokens = prompt(30, 4 * BLOCK + 1)
    runner.run([tokens])
    runner.drop_gpu_cache()

    again = runner.run([tokens])

    (engine,) = FaultySpec.engines
    loads = [job for job in engine.submitted if job.direction is Direction.LOAD]
    assert len(engine.failed) == 1 and len(loads) == 2, "the failed load was not resubmitted"
    assert loads[0].host_records == loads[1].host_records
    assert again.connector_hits == 4 * BLOCK and again.verified_tokens == 4 * BLOCK


def test_store_failing_every_attempt_stops_the_engine_and_never_becomes_loadable(
    make_runner: RunnerFactory,
) -> None:
    FaultySpec.configure()
    FaultySpec.fail_every(Direction.STORE)
    runner = make_runner(
        blocks_per_chunk=1, host_bytes=POOL, spec_name="FaultySpec", spec_module_path=FAULTY,
        extra_config={"transfer_retries": 2},
    )
    with pytest.raises(VLLMTransferError, match=r"store of vLLM job \d+ failed on all 3 attempt"):
        runner.run([prompt(40, 2 * BLOCK + 1)])

    (engine,) = FaultySpec.engines
    assert len(engine.failed) == 3
    stats = runner.manager.stats()
    assert stats.stores_completed == 0 and stats.host.ready == 0, "a failed store became loadable"


def test_load_failing_every_attempt_stops_the_engine_before_the_request_runs(
    make_runner: RunnerFactory,
) -> None:
    FaultySpec.configure()
    runner = make_runner(
        blocks_per_chunk=1, host_bytes=POOL, spec_name="FaultySpec", spec_module_path=FAULTY,
        extra_config={"transfer_retries": 0},
    )
    tokens = prompt(50, 2 * BLOCK + 1)
    runner.run([tokens])
    runner.drop_gpu_cache()
    FaultySpec.fail_every(Direction.LOAD)

    with pytest.raises(VLLMTransferError, match="load of vLLM job .* GPU blocks hold undefined"):
        runner.run([tokens])
    assert runner.stats.verified_tokens == 0, "the request ran on a failed load's blocks"
