"""kvoffload as vLLM's offloading spec on a GPU: vLLM's scheduler and connector, the cuda backend.

The same engine runner as the CPU integration suite (``tests/integration/vllm``), with the KV cache
on the GPU, so the adapter's worker runs kvoffload's cuda backend: stores ordered after the
runner's KV writes on the current stream, loads checked byte by byte before the next forward pass.
Needs vllm==0.33.0 importable next to a CUDA build of torch; skipped, saying which is missing,
otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvoffload

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vllm==0.33.0 is not installed (see tests/integration/vllm)")

from tests.integration.vllm._runner import EngineRunner  # noqa: E402
from tests.integration.vllm.faulty_spec import RecordingSpec  # noqa: E402

BLOCK = 16
POOL = 64 << 20


def prompt(seed: int, length: int) -> list[int]:
    return [3 + (seed * 131 + i * 31) % 500 for i in range(length)]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_reloaded_blocks_on_the_gpu_are_byte_identical(
    device: torch.device, blocks_per_chunk: int
) -> None:
    runner = EngineRunner(blocks_per_chunk=blocks_per_chunk, host_bytes=POOL, device=str(device))
    try:
        tokens = prompt(1, 7 * BLOCK + 5)
        runner.run([tokens])
        engine = runner.worker.engine
        assert isinstance(engine, kvoffload.Worker) and engine.stats().backend == "cuda"
        runner.drop_gpu_cache()
        again = runner.run([tokens])
        expected = (7 // blocks_per_chunk) * blocks_per_chunk * BLOCK
        assert again.connector_hits == expected and again.verified_tokens == expected
    finally:
        runner.close()


def test_unaligned_load_on_the_gpu_skips_the_first_record(device: torch.device) -> None:
    RecordingSpec.configure()
    runner = EngineRunner(
        blocks_per_chunk=2, host_bytes=POOL, device=str(device), spec_name="RecordingSpec",
        spec_module_path="tests.integration.vllm.faulty_spec",
    )
    try:
        tokens = prompt(2, 6 * BLOCK + 3)
        runner.run([tokens])
        runner.drop_gpu_cache()
        runner.run([tokens[:BLOCK] + prompt(3, BLOCK + 3)])
        again = runner.run([tokens])
        assert again.connector_hits == 5 * BLOCK and again.verified_tokens == 6 * BLOCK
    finally:
        runner.close()
