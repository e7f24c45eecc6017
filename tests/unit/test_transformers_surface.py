"""Canaries for the private parts of transformers' continuous batching that the integration hooks.

Each test pins one assumption of ``kvoffload.integrations._transformers_surface`` on the installed
transformers; when an upgrade moves a name or changes a behaviour, the failing test names it. CI
installs the ``transformers`` extra (a missing transformers fails there, see ``_cb_workload``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.unit._cb_workload import require_transformers

require_transformers()

from kvoffload.integrations import _transformers_surface as surface  # noqa: E402
from tests.unit._cb_workload import PAGE, PREFIX, cb_configs, serve, tiny_llama  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, FP32_BYTES = 2, 2, 16, 4


def blake2b_chain(tokens: Sequence[int], page: int) -> list[int]:
    """The engine's block hashes computed independently: blake2b-64 of the parent hash (8 bytes,
    little endian) and the block's tokens as int32, for every block but the one of the last token."""
    out: list[int] = []
    parent: int | None = None
    for b in range((len(tokens) - 1) // page):
        h = hashlib.blake2b(digest_size=8)
        if parent is not None:
            h.update(parent.to_bytes(8, "little"))
        h.update(array("i", tokens[b * page:(b + 1) * page]).tobytes())
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


class _Capture:
    """Hooks that change nothing and keep the session's cache."""

    def __init__(self) -> None:
        self.caches: list[surface.EngineCache] = []

    def bind(self, cache: surface.EngineCache) -> _Capture:
        self.caches.append(cache)
        return self

    @property
    def active(self) -> bool:
        return True

    def before_schedule(self) -> bool:
        return True

    def before_prefix_match(self, prompt: Sequence[int]) -> object:
        return None

    def after_prefix_match(self, token: object, matched_tokens: int) -> None:
        pass

    def after_schedule(self, chunks: list[surface.ScheduledChunk] | None, starved: bool) -> bool:
        return False


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama(torch.device("cpu"), torch.float32)


@pytest.fixture
def served(model: Any) -> surface.EngineCache:
    """The engine cache of a finished session that served ``PREFIX + [200, 201]``."""
    capture = _Capture()
    surface.register_model(model, capture.bind)
    try:
        gen, cb = cb_configs(16)
        model.generate_batch([PREFIX + [200, 201]], generation_config=gen, continuous_batching_config=cb)
    finally:
        surface.unregister_model(model)
    assert len(capture.caches) == 1
    return capture.caches[0]


def test_the_installed_transformers_is_in_the_supported_range() -> None:
    version = surface.installed_version()
    assert version is not None and surface.version_supported(version), (version, surface.SUPPORTED_RANGE)


@pytest.mark.parametrize(("version", "supported"), [
    ("5.24.0", True), ("5.24.3", True), ("5.24.0rc1", True), ("5.23.9", False), ("5.25.0", False),
    ("5.25.0.dev0", False), ("6.0.0", False), ("4.99.0", False), ("main", False),
])
def test_the_supported_range_is_5_24_only(version: str, supported: bool) -> None:
    assert surface.version_supported(version) is supported


def test_every_private_name_the_integration_uses_is_where_it_was() -> None:
    surface.check_surface()


def test_a_missing_name_is_reported_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching import scheduler

    monkeypatch.delattr(scheduler, "SCHEDULER_MAPPING")
    with pytest.raises(surface.SurfaceError, match="scheduler.SCHEDULER_MAPPING: missing"):
        surface.check_surface()


def test_a_changed_signature_is_reported_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching import scheduler

    def moved(self: object, state: object) -> None:
        pass

    monkeypatch.setattr(scheduler.Scheduler, "_infer_request_tokens", moved)
    with pytest.raises(surface.SurfaceError, match=r"Scheduler._infer_request_tokens: expected parameters"):
        surface.check_surface()


def test_block_hashes_are_the_stable_blake2b_chain_the_engine_registers(served: surface.EngineCache) -> None:
    prompt = PREFIX + [200, 201]
    hashes = served.block_hashes(prompt)
    assert hashes == blake2b_chain(prompt, PAGE)  # no per-process salt: valid across processes
    blocks = served.resident_prefix(hashes)
    assert len(blocks) == len(PREFIX) // PAGE  # the engine registered exactly these after serving
    assert [served.hash_of(b) for b in blocks] == hashes


def test_the_cache_is_one_uint8_tensor_whose_rows_are_whole_blocks(served: surface.EngineCache) -> None:
    view = served.block_view()
    tensor = served.engine_cache.cache_tensor  # type: ignore[attr-defined]
    assert tensor.dtype == torch.uint8 and tensor.dim() == 1
    assert served.bytes_per_block == 2 * LAYERS * KV_HEADS * HEAD_DIM * FP32_BYTES * PAGE
    assert view.shape == (tensor.numel() // served.bytes_per_block, served.bytes_per_block)
    assert view.data_ptr() == tensor.data_ptr() and view.is_contiguous()
    assert served.tokens_per_block == PAGE and served.prefix_sharing


def test_a_block_holds_every_layers_keys_and_values_of_its_tokens(served: surface.EngineCache) -> None:
    allocator = next(iter(served.engine_cache.cache_allocators.values()))  # type: ignore[attr-defined]
    block = served.resident_prefix(served.block_hashes(PREFIX + [200, 201]))[0]
    row = served.block_view()[block].view(torch.float32)
    for layer in range(LAYERS):
        k_view, v_view = allocator._kv_token_views[layer]  # the engine's own per-layer views
        start = block * allocator.block_physical_stride
        keys = k_view[start:start + PAGE].reshape(-1)
        values = v_view[start:start + PAGE].reshape(-1)
        assert torch.count_nonzero(keys) > 0
        inside = [torch.equal(row[i:i + keys.numel()], keys) for i in range(0, row.numel(), keys.numel())]
        assert inside.count(True) == 1, f"layer {layer} keys are not one run of the block's row"
        inside = [torch.equal(row[i:i + values.numel()], values) for i in range(0, row.numel(), values.numel())]
        assert inside.count(True) == 1, f"layer {layer} values are not one run of the block's row"


def test_layer_i_of_the_layer_view_is_the_keys_then_values_of_layer_order_i(served: surface.EngineCache) -> None:
    allocator = next(iter(served.engine_cache.cache_allocators.values()))  # type: ignore[attr-defined]
    assert served.layer_order == tuple(range(LAYERS))
    view = served.layer_block_view()
    assert view.shape == (served.block_view().shape[0], LAYERS, served.bytes_per_block // LAYERS)
    block = served.resident_prefix(served.block_hashes(PREFIX + [200, 201]))[0]
    for i, layer in enumerate(served.layer_order):
        k_view, v_view = allocator._kv_token_views[layer]  # the engine's own per-layer views
        start = block * allocator.block_physical_stride
        keys = k_view[start:start + PAGE].reshape(-1)
        values = v_view[start:start + PAGE].reshape(-1)
        pair = view[block, i].view(torch.float32)
        assert torch.count_nonzero(keys) > 0
        assert torch.equal(pair[:keys.numel()], keys) and torch.equal(pair[keys.numel():], values), layer


def test_attention_layers_are_the_modules_that_read_and_write_each_layers_cache(model: Any) -> None:
    layers = surface.attention_layers(model)
    assert sorted(layers) == list(range(LAYERS))
    seen: list[int] = []
    handles = [m.register_forward_pre_hook(lambda m, a, i=i: seen.append(i)) for i, m in layers.items()]
    try:
        gen, cb = cb_configs(16)
        model.generate_batch([PREFIX + [200, 201]], generation_config=gen, continuous_batching_config=cb)
    finally:
        for handle in handles:
            handle.remove()
    assert seen[:LAYERS] == list(range(LAYERS))  # every forward runs them in layer order


def test_a_forgotten_block_is_never_matched_and_returns_to_the_pool_when_released(
    served: surface.EngineCache,
) -> None:
    hashes = served.block_hashes(PREFIX + [200, 201])
    blocks = served.resident_prefix(hashes)
    free = served.available_blocks()
    served.hold(blocks[0])
    served.forget(blocks[0])
    assert served.hash_of(blocks[0]) is None and served.resident_prefix(hashes) == []
    served.release(blocks[0])
    assert served.available_blocks() == free + 1  # was cached (not free); now back in the pool


def test_a_held_block_survives_the_engines_eviction_and_is_evictable_after_release(
    served: surface.EngineCache,
) -> None:
    cache: Any = served.engine_cache
    blocks = served.resident_prefix(served.block_hashes(PREFIX + [200, 201]))
    served.hold(blocks[0])
    cache.evict_cached_blocks()  # what the scheduler does under memory pressure
    assert served.hash_of(blocks[0]) is not None
    assert all(served.hash_of(b) is None for b in blocks[1:])
    served.release(blocks[0])
    assert served.hash_of(blocks[0]) is not None  # unreferenced and complete: cached, not freed
    cache.evict_cached_blocks()
    assert served.hash_of(blocks[0]) is None


def test_registered_blocks_are_matched_by_the_engines_prefix_search(served: surface.EngineCache) -> None:
    cache: Any = served.engine_cache
    cache.evict_cached_blocks()
    prompt = PREFIX + [200, 201]
    hashes = served.block_hashes(prompt)
    room = served.available_blocks()
    blocks = served.take_blocks(len(hashes))
    assert served.available_blocks() == room - len(hashes)
    assert served.register_held(blocks, hashes) == len(hashes)
    assert cache.search_prefix_match("probe", prompt) == len(hashes) * PAGE
    allocator = next(iter(cache.cache_allocators.values()))
    assert allocator.block_table["probe"] == blocks
    for block in blocks:
        served.release(block)
    cache.free_blocks("probe")
    assert served.evict_cached(len(blocks)) == len(blocks)
    assert served.available_blocks() == room


def test_evict_cached_spares_the_blocks_it_is_told_to_keep(served: surface.EngineCache) -> None:
    blocks = served.resident_prefix(served.block_hashes(PREFIX + [200, 201]))
    assert served.evict_cached(len(blocks), keep=blocks[:2]) == len(blocks) - 2
    assert [served.hash_of(b) is not None for b in blocks] == [True, True] + [False] * (len(blocks) - 2)


def test_interception_reports_new_complete_blocks_and_is_removed(served: surface.EngineCache) -> None:
    seen: list[tuple[int, int]] = []
    served.intercept_new_hashes(lambda block, block_hash: seen.append((block, block_hash)))
    ledger: Any = served.engine_cache.cache_allocators["full_attention"].ledger  # type: ignore[attr-defined]
    block = served.take_blocks(1)[0]
    assert ledger.register_new_hash(block, 12345) is None
    known = next(iter(ledger.hash_to_block))
    assert ledger.register_new_hash(block + 1, known) is not None  # a duplicate: not reported
    assert seen == [(block, 12345)]
    served.stop_intercepting()
    assert "register_new_hash" not in vars(ledger)


def test_the_scheduler_mapping_is_wrapped_while_registered_and_restored() -> None:
    from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

    model_a, model_b = object(), object()
    surface.register_model(model_a, lambda cache: None)
    surface.register_model(model_b, lambda cache: None)
    with pytest.raises(surface.SurfaceError, match="registered already"):
        surface.register_model(model_a, lambda cache: None)
    assert SCHEDULER_MAPPING["fifo"] is not FIFOScheduler
    surface.unregister_model(model_a)
    assert not surface.mapping_is_original()
    surface.unregister_model(model_b)
    assert SCHEDULER_MAPPING["fifo"] is FIFOScheduler and surface.mapping_is_original()
    surface.unregister_model(model_b)  # idempotent


def test_an_entry_replaced_by_someone_else_is_left_alone() -> None:
    from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

    config = object()
    surface.register_model(config, lambda cache: None)
    original = SCHEDULER_MAPPING["prefill_first"]
    SCHEDULER_MAPPING["prefill_first"] = dict  # another library's scheduler
    try:
        surface.unregister_model(config)
        assert SCHEDULER_MAPPING["prefill_first"] is dict
    finally:
        SCHEDULER_MAPPING["prefill_first"] = original.original if isinstance(original, surface._SchedulerFactory) else original
    assert surface.mapping_is_original()


def test_a_scheduler_reports_its_starved_requests(served: surface.EngineCache) -> None:
    from transformers.generation.continuous_batching.scheduler import FIFOScheduler

    scheduler = FIFOScheduler(served.engine_cache, 0.1, 4)
    assert scheduler.starved_requests == []


def test_a_hooked_scheduler_is_a_subclass_of_the_one_it_replaces(model: Any) -> None:
    from transformers.generation.continuous_batching.scheduler import PrefillFirstScheduler

    capture = _Capture()
    surface.register_model(model, capture.bind)
    try:
        gen, cb = cb_configs(16)
        cb.scheduler_type = "prefill_first"
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                       warmup=False) as manager:
            assert serve(manager, PREFIX + [200]).error is None  # the session built its scheduler
            scheduler = manager.batch_processor.scheduler
            assert isinstance(scheduler, PrefillFirstScheduler) and type(scheduler) is not PrefillFirstScheduler
    finally:
        surface.unregister_model(model)
    assert len(capture.caches) == 1
