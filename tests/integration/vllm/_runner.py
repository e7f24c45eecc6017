"""An engine loop around vLLM's real ``Scheduler`` and both ``OffloadingConnector`` roles, on CPU.

The runner plays vLLM's model runner: each step it calls the worker-side connector in the order
vLLM 0.33's model runner does (``handle_preemptions``, ``bind_connector_metadata``, the forward
pass with ``start_load_kv`` before it when the step has loads it waits for and after it otherwise,
``wait_for_save`` on every step, ``get_finished``, ``build_connector_worker_meta``,
``clear_connector_metadata``) and hands the scheduler a
``ModelRunnerOutput`` carrying the connector's output. The scheduler, its KV cache manager, both
connector roles and the offloading spec are vLLM's and kvoffload's own, unmodified.

The "forward pass" is a stand-in for attention that makes the KV checkable: before computing a
request's scheduled tokens it verifies that every token before them holds the bytes
:func:`token_kv` gives for that token's prefix (whether the GPU prefix cache kept them or the
connector loaded them), then writes those bytes for the scheduled tokens. A reloaded byte that
differs from what was stored fails the step with :class:`KVMismatch`.
"""

from __future__ import annotations

import hashlib
import pathlib
import time
from collections.abc import Iterable
from typing import Any, Final

import attrs
import torch

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.integrations.vllm import KVOffloadManager, KVOffloadSpec, KVOffloadWorker

#: A tiny Llama-shaped model config shipped with the tests (nothing is loaded from a hub).
MODEL_DIR: Final = pathlib.Path(__file__).resolve().parent / "tiny_llama"
SPEC_MODULE: Final = "kvoffload.integrations.vllm"
NUM_LAYERS: Final = 2
NUM_KV_HEADS: Final = 2
HEAD_SIZE: Final = 16
#: K and V of every head of one token of one layer, in fp16.
TOKEN_BYTES: Final = 2 * NUM_KV_HEADS * HEAD_SIZE * 2
EOS_TOKEN_ID: Final = 2
MAX_STEPS: Final = 2000
#: A step that scheduled nothing (the engine waits for transfers) pauses this long.
IDLE_STEP_S: Final = 0.001


class KVMismatch(AssertionError):
    """A token's KV on the device is not the bytes that were computed (or stored) for it."""


def token_kv(layer: int, prefix_digest: bytes) -> bytes:
    """The KV bytes of one token of one layer: a function of the token and everything before it,
    as real attention KV is. ``prefix_digest`` is :func:`prefix_digests`' entry for the token."""
    person = f"layer{layer}".encode()
    first = hashlib.blake2b(prefix_digest, digest_size=64, person=person, salt=b"K").digest()
    second = hashlib.blake2b(prefix_digest, digest_size=64, person=person, salt=b"V").digest()
    return first + second


def prefix_digests(tokens: Iterable[int]) -> list[bytes]:
    """A digest per position, chained over the tokens up to and including it."""
    out: list[bytes] = []
    state = b""
    for token in tokens:
        state = hashlib.blake2b(state + token.to_bytes(4, "little"), digest_size=16).digest()
        out.append(state)
    return out


@attrs.define
class Stats:
    """What the runner observed, summed over its steps."""

    steps: int = 0
    verified_tokens: int = 0
    connector_queries: int = 0
    connector_hits: int = 0
    finished: list[str] = attrs.Factory(list)


class EngineRunner:
    """vLLM's scheduler and the worker-side connector over CPU KV tensors (see the module docstring).

    Owns the KV tensors, the scheduler (and through it the scheduler-side connector) and the
    worker-side connector; :meth:`close` shuts both connector roles down.
    """

    def __init__(
        self,
        *,
        blocks_per_chunk: int,
        host_bytes: int,
        num_gpu_blocks: int = 128,
        block_size: int = 16,
        max_num_batched_tokens: int = 256,
        spec_name: str = "KVOffloadSpec",
        spec_module_path: str = SPEC_MODULE,
        extra_config: dict[str, Any] | None = None,
        kv_events: bool = True,
        device: str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_gpu_blocks = num_gpu_blocks
        config_extra: dict[str, Any] = {
            "spec_name": spec_name,
            "spec_module_path": spec_module_path,
            "blocks_per_chunk": blocks_per_chunk,
            "host_bytes": host_bytes,
            **(extra_config or {}),
        }
        self.vllm_config = build_vllm_config(
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            extra_config=config_extra,
            kv_events=kv_events,
            device=self.device.type,
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    layer_names,
                    FullAttentionSpec(
                        block_size=block_size,
                        num_kv_heads=NUM_KV_HEADS,
                        head_size=HEAD_SIZE,
                        dtype=torch.float16,
                    ),
                )
            ],
        )
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        with set_current_vllm_config(self.vllm_config):
            self.scheduler = Scheduler(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=block_size,
                log_stats=True,
            )
            self.worker_connector = OffloadingConnector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
            #: The device KV cache: one tensor per layer, blocks first, a token's KV per row.
            self.kv: dict[str, torch.Tensor] = {
                name: torch.zeros(
                    num_gpu_blocks, block_size, TOKEN_BYTES, dtype=torch.int8, device=self.device
                )
                for name in layer_names
            }
            self.worker_connector.register_kv_caches(self.kv)
        self.layer_names = layer_names
        self.stats = Stats()
        self._prompts: dict[str, list[int]] = {}
        self._digests: dict[str, list[bytes]] = {}
        self._next_id = 0
        self._closed = False

    # ------------------------------------------------------------------------------ access

    @property
    def scheduler_connector(self) -> OffloadingConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        return connector

    @property
    def spec(self) -> KVOffloadSpec:
        """The worker-side spec vLLM built from the config."""
        worker = self.worker_connector.connector_worker
        assert worker is not None and isinstance(worker.spec, KVOffloadSpec)
        return worker.spec

    @property
    def manager(self) -> KVOffloadManager:
        """The scheduler-side manager vLLM built."""
        manager = self.scheduler_connector.connector_scheduler.manager
        assert isinstance(manager, KVOffloadManager)
        return manager

    @property
    def worker(self) -> KVOffloadWorker:
        """The worker-side transfers vLLM built."""
        worker = self.worker_connector.connector_worker
        assert worker is not None and isinstance(worker.worker, KVOffloadWorker)
        return worker.worker

    # ---------------------------------------------------------------------------- requests

    def add_request(self, prompt: list[int], *, max_tokens: int = 1) -> str:
        """Queue a request for ``prompt``; returns its id."""
        req_id = f"req-{self._next_id}"
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self._prompts[req_id] = list(prompt)
        self.scheduler.add_request(request)
        return req_id

    def run(self, prompts: list[list[int]], *, max_tokens: int = 1) -> Stats:
        """Queue ``prompts`` and step until every request finished and every job completed; returns
        what these steps observed."""
        before = attrs.evolve(self.stats, finished=list(self.stats.finished))
        for prompt in prompts:
            self.add_request(prompt, max_tokens=max_tokens)
        self.run_until_idle()
        return Stats(
            steps=self.stats.steps - before.steps,
            verified_tokens=self.stats.verified_tokens - before.verified_tokens,
            connector_queries=self.stats.connector_queries - before.connector_queries,
            connector_hits=self.stats.connector_hits - before.connector_hits,
            finished=self.stats.finished[len(before.finished) :],
        )

    def run_until_idle(self) -> None:
        """Step until the scheduler holds no request and the connector no job."""
        for _ in range(MAX_STEPS):
            if not self.scheduler.has_requests() and not self.scheduler_connector.has_pending_push_work():
                return
            self.step()
        raise AssertionError(f"the engine did not become idle within {MAX_STEPS} steps")

    # -------------------------------------------------------------------------------- step

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, run the worker side, feed the output back."""
        with set_current_vllm_config(self.vllm_config):
            return self._step()

    def _step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        assert meta is not None
        worker = self.worker_connector
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        # As vLLM's model runner: a step's loads start after its forward pass unless the step has
        # loads it waits for (they feed this forward), and wait_for_save runs on every step, one
        # that schedules no token too (skipping it there dropped that step's stores: found by an
        # audit of this runner against vLLM's own).
        context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        loads_after = not output.has_sync_kv_loads
        if not loads_after:
            worker.start_load_kv(context)
        sampled = self._forward(output)
        if loads_after:
            worker.start_load_kv(context)
        worker.wait_for_save()
        finished_sending, finished_recving = worker.get_finished(output.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        req_ids = list(sampled)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=[sampled[req_id] for req_id in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=finished_sending or None,
                finished_recving=finished_recving or None,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    self.stats.finished.append(out.request_id)
            stats = outputs.scheduler_stats
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                self.stats.connector_queries += stats.connector_prefix_cache_stats.queries
                self.stats.connector_hits += stats.connector_prefix_cache_stats.hits
        self.stats.steps += 1
        if not output.total_num_scheduled_tokens:
            time.sleep(IDLE_STEP_S)  # jobs run on kvoffload's threads meanwhile
        return output

    def _forward(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """Verify the KV before each scheduled chunk, write the chunk's KV; the sampled tokens."""
        starts: dict[str, int] = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled: dict[str, list[int]] = {}
        for req_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tokens = list(request.all_token_ids)
            digests = self._digests_of(req_id, tokens)
            (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            start = starts[req_id]
            self.stats.verified_tokens += self._verify(req_id, blocks, digests, start)
            self._write(blocks, digests, start, start + count)
            done = start + count >= request.num_tokens
            sampled[req_id] = [100 + (len(tokens) % 50)] if done else []
        return sampled

    def _digests_of(self, req_id: str, tokens: list[int]) -> list[bytes]:
        known = self._digests.get(req_id, [])
        if len(known) < len(tokens):
            known = prefix_digests(tokens)
            self._digests[req_id] = known
        return known

    def _positions(self, blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (GPU block, slot) index tensors of token positions ``start .. end - 1``."""
        positions = torch.arange(start, end)
        table = torch.as_tensor(blocks, dtype=torch.long)
        return (
            table[positions // self.block_size].to(self.device),
            (positions % self.block_size).to(self.device),
        )

    def _expected(self, layer: int, digests: list[bytes], start: int, end: int) -> torch.Tensor:
        rows = b"".join(token_kv(layer, digests[p]) for p in range(start, end))
        return torch.frombuffer(bytearray(rows), dtype=torch.int8).reshape(end - start, TOKEN_BYTES)

    def _verify(self, req_id: str, blocks: list[int], digests: list[bytes], end: int) -> int:
        if end == 0:
            return 0
        index = self._positions(blocks, 0, end)
        for layer, name in enumerate(self.layer_names):
            got = self.kv[name][index].cpu()
            bad = (got != self._expected(layer, digests, 0, end)).any(dim=1).nonzero()
            if bad.numel():
                position = int(bad[0, 0])
                block, slot = blocks[position // self.block_size], position % self.block_size
                raise KVMismatch(
                    f"{req_id}: token {position} of layer {layer} (GPU block {block}, slot "
                    f"{slot}) does not hold its KV before the forward pass "
                    f"({bad.numel()} of {end} tokens differ)"
                )
        return end

    def _write(self, blocks: list[int], digests: list[bytes], start: int, end: int) -> None:
        if end == start:
            return
        index = self._positions(blocks, start, end)
        for layer, name in enumerate(self.layer_names):
            self.kv[name][index] = self._expected(layer, digests, start, end).to(self.device)

    # ------------------------------------------------------------------------- cache state

    def drop_gpu_cache(self) -> None:
        """Forget the GPU prefix cache and zero every KV byte (the offloaded copies are untouched)."""
        assert self.scheduler.kv_cache_manager.reset_prefix_cache(), "requests still hold blocks"
        for tensor in self.kv.values():
            tensor.zero_()

    def reset_connector(self) -> None:
        """vLLM's full reset: the GPU prefix cache and the connector's cache (its jobs in flight are
        flushed by the next steps)."""
        assert self.scheduler.reset_prefix_cache(reset_connector=True)

    def close(self) -> None:
        """Shut both connector roles down (once)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.worker_connector.shutdown()
        finally:
            self.scheduler_connector.shutdown()


def build_vllm_config(
    *,
    block_size: int,
    max_num_batched_tokens: int,
    extra_config: dict[str, Any],
    kv_events: bool,
    device: str = "cpu",
) -> VllmConfig:
    """A ``VllmConfig`` for the shipped tiny model, with the offloading connector."""
    model_config = ModelConfig(model=str(MODEL_DIR), dtype="float16", seed=0, skip_tokenizer_init=True)
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config=extra_config,
    )
    events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=transfer_config,
        kv_events_config=events_config,
        device_config=DeviceConfig(device),
    )
    return config
