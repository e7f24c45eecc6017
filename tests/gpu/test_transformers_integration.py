"""kvoffload as the host tier of transformers' continuous batching on a GPU (cuda backend, bf16).

The CPU suite's phases (A: prompts with prefix P, B: a filler that evicts P from a 16-block engine
cache, C: new prompts with prefix P), one request at a time, on the GPU in bf16. Skipped, saying
why, without CUDA or without transformers in the supported range.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit._cb_workload import require_transformers

require_transformers()

import kvoffload  # noqa: E402
from kvoffload import DiskConfig  # noqa: E402
from kvoffload.integrations.transformers import OffloadStats, WorkerLike, offloading  # noqa: E402
from tests.gpu.conftest import Figures  # noqa: E402
from tests.unit._cb_workload import (  # noqa: E402
    BIG_CACHE_BLOCKS,
    PHASES,
    PREFIX_BLOCKS,
    SMALL_CACHE_BLOCKS,
    SUFFIX_TOKENS_C,
    DelayedLayers,
    FailingLoads,
    PhaseRun,
    cb_configs,
    run_phases,
    serve,
    tiny_llama,
)


@pytest.fixture(scope="module")
def model() -> Any:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return tiny_llama(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)


@pytest.fixture(scope="module")
def big_cache_run(model: Any) -> PhaseRun:
    run = run_phases(model, BIG_CACHE_BLOCKS)
    assert not run.errors
    return run


@pytest.fixture(scope="module")
def small_cache_run(model: Any) -> PhaseRun:
    """The plain small cache's run, without offloading: the figure's baseline."""
    return run_phases(model, SMALL_CACHE_BLOCKS)


def _offloaded(model: Any, **kwargs: Any) -> tuple[PhaseRun, OffloadStats]:
    with offloading(model, 64, **kwargs) as off:
        run = run_phases(model, SMALL_CACHE_BLOCKS, off)
    assert not run.errors, run.errors
    return run, off.stats()


def _bits(values: list[float]) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


@pytest.mark.parametrize(("overlap_loads", "defer_loads"), [(True, None), (True, False), (False, None)],
                         ids=["layer-by-layer", "submitted-at-the-match", "waited"])
def test_gpu_offload_tokens_and_logprobs_equal_the_big_cache_run(
    model: Any, big_cache_run: PhaseRun, small_cache_run: PhaseRun, figures: Figures, overlap_loads: bool,
    defer_loads: bool | None
) -> None:
    run, stats = _offloaded(model, overlap_loads=overlap_loads, defer_loads=defer_loads)
    for name, (tokens, logprobs) in run.outputs.items():
        assert tokens == big_cache_run.outputs[name][0], name
        assert _bits(logprobs) == _bits(big_cache_run.outputs[name][1]), name
    assert stats.blocks_loaded_host == PREFIX_BLOCKS and stats.blocks_load_failed == 0
    assert run.prompt_tokens("C") == SUFFIX_TOKENS_C
    mode = "waited" if not overlap_loads else "layer-by-layer" + (", at the match" if defer_loads is False else "")
    figures.add(f"transformers CB ({mode} loads), phase C prompt "
                "tokens computed (offload / plain small cache)",
                f"{run.prompt_tokens('C')} / {small_cache_run.prompt_tokens('C')}")


def test_gpu_failed_load_is_recomputed_with_identical_tokens(model: Any, big_cache_run: PhaseRun) -> None:
    def failing(layout: kvoffload.DeviceLayout, blocks: int, disk: DiskConfig | None) -> WorkerLike:
        return FailingLoads(kvoffload.Worker.create(layout, blocks, disk=disk))

    run, stats = _offloaded(model, make_worker=failing, overlap_loads=False)
    assert stats.blocks_load_failed == PREFIX_BLOCKS and stats.blocks_loaded_host == 0
    assert [o[0] for o in run.outputs.values()] == [o[0] for o in big_cache_run.outputs.values()]


@pytest.mark.parametrize("ordered", [True, False], ids=["real", "control"])
def test_gpu_attention_layers_wait_on_the_device_for_a_load_in_flight(
    model: Any, big_cache_run: PhaseRun, ordered: bool, figures: Figures
) -> None:
    made: list[DelayedLayers] = []

    def delayed(layout: kvoffload.DeviceLayout, blocks: int, disk: DiskConfig | None) -> WorkerLike:
        made.append(DelayedLayers(kvoffload.Worker.create(layout, blocks, disk=disk), ordered=ordered))
        return made[-1]

    run, _ = _offloaded(model, make_worker=delayed)  # each load starts 0.5 s after its step was scheduled
    assert made[0].handles, "no layer-by-layer load ran"
    if ordered:
        assert run.outputs == big_cache_run.outputs
    else:
        figures.add("transformers CB, control: a forward that does not wait for the load in flight",
                    f"C0 tokens equal the big cache's: {run.outputs['C0'] == big_cache_run.outputs['C0']}")
        assert run.outputs["C0"] != big_cache_run.outputs["C0"], "the control cannot fail"


def test_gpu_copies_are_ordered_on_the_engines_compute_stream(model: Any) -> None:
    gen, cb = cb_configs(SMALL_CACHE_BLOCKS)
    with offloading(model, 64) as off:
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                       warmup=False) as manager:
            assert serve(manager, PHASES["A"][0]).error is None
            compute = manager.batch_processor.inputs_and_outputs.compute_stream
            recorded = off._compute_stream
    assert isinstance(recorded, torch.cuda.Stream) and compute is not None
    assert recorded.cuda_stream == compute.cuda_stream  # not the default stream of the engine's thread
    assert recorded.cuda_stream != torch.cuda.default_stream(model.device).cuda_stream


def test_gpu_async_batching_keeps_the_tokens_of_the_big_cache_run(model: Any) -> None:
    def phases(num_blocks: int) -> dict[str, list[int]]:
        gen, cb = cb_configs(num_blocks)
        cb.use_async_batching = True  # the next step is scheduled while the previous forward runs
        out: dict[str, list[int]] = {}
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                       warmup=False) as manager:
            for phase, prompts in PHASES.items():
                for i, prompt in enumerate(prompts):
                    result = serve(manager, prompt)
                    assert result.error is None, result.error
                    out[f"{phase}{i}"] = list(result.generated_tokens)
        return out

    big = phases(BIG_CACHE_BLOCKS)
    with offloading(model, 64) as off:
        offloaded = phases(SMALL_CACHE_BLOCKS)
    assert off.stats().blocks_loaded_host == PREFIX_BLOCKS
    assert offloaded == big
