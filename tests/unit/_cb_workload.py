"""A workload for transformers' continuous batching in phases, shared by the CPU and GPU suites.

Phase ``A`` serves prompts that share a prefix ``P``, ``B`` a filler that needs most of a small
engine cache (so that ``P`` leaves it), ``C`` new prompts with prefix ``P``. Requests run one at a
time, so every forward holds one request and the runs compare bit for bit. transformers is imported
only inside the functions (the test modules decide first whether it must be present).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import attrs
import pytest
import torch

import kvoffload
from kvoffload.integrations.transformers import LayerWaiter, Offloader

REQUIRE_ENV: Final = "KVOFFLOAD_REQUIRE_TRANSFORMERS"
RESULT_TIMEOUT_S: Final = 120.0
PAGE: Final = 16
NEW_TOKENS: Final = 6
SMALL_CACHE_BLOCKS: Final = 16
BIG_CACHE_BLOCKS: Final = 64
PREFIX: Final = list(range(1, 97))  # six complete blocks of 16 tokens
PHASES: Final[dict[str, list[list[int]]]] = {
    "A": [PREFIX + [200, 201, 202, 203, 204], PREFIX + [210, 211, 212]],
    "B": [[(7 * i) % 250 + 3 for i in range(190)]],
    "C": [PREFIX + [220, 221, 222, 223], PREFIX + [230, 231]],
}
SUFFIX_TOKENS_C: Final = sum(len(p) - len(PREFIX) for p in PHASES["C"])
PREFIX_BLOCKS: Final = len(PREFIX) // PAGE


def require_transformers() -> None:
    """Skip (printing why) when transformers is missing or unsupported, or fail when the environment
    says it must be there (CI sets ``KVOFFLOAD_REQUIRE_TRANSFORMERS=1`` and installs it)."""
    from kvoffload.integrations import _transformers_surface as surface

    version = surface.installed_version() if importlib.util.find_spec("transformers") else None
    if version is not None and surface.version_supported(version):
        return
    found = "not installed" if version is None else f"{version}, outside {surface.SUPPORTED_RANGE}"
    reason = f"transformers is {found}: pip install 'kvoffload[transformers]'"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: the transformers integration must be tested here)",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def tiny_llama(device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight two-layer Llama (vocab 256, 2 KV heads x 16), sdpa attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


@attrs.frozen
class PhaseRun:
    """Outputs per request (``"A0"``...), tokens through the model and stats after each phase."""

    outputs: dict[str, tuple[list[int], list[float]]]
    forward_tokens: dict[str, int]
    stats: dict[str, Any]
    errors: list[str]

    def prompt_tokens(self, phase: str) -> int:
        """Prompt tokens that ran through the model in ``phase`` (every token beyond the first of a
        request's output was one decode forward of one token)."""
        return self.forward_tokens[phase] - len(PHASES[phase]) * (NEW_TOKENS - 1)


@contextlib.contextmanager
def count_forward_tokens(model: Any) -> Iterator[list[int]]:
    """Counts the query tokens of every forward of ``model`` (element 0 of the yielded list)."""
    count = [0]

    def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        count[0] += int(kwargs["input_ids"].shape[-1])

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()


def cb_configs(num_blocks: int, allow_block_sharing: bool = True) -> tuple[Any, Any]:
    """A greedy generation config and a continuous batching config with ``num_blocks`` blocks."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=256,
                                  return_logprobs=True, use_cuda_graph=False, use_async_batching=False,
                                  allow_block_sharing=allow_block_sharing)
    return gen, cb


def serve(manager: Any, prompt: Sequence[int]) -> Any:
    """Submit one request and wait for its final output."""
    rid = manager.add_request(list(prompt), max_new_tokens=NEW_TOKENS)
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        result = manager.get_result(request_id=rid, timeout=1.0)
        if result is not None and result.is_finished():
            return result
    raise AssertionError(f"request {rid} did not finish within {RESULT_TIMEOUT_S} s")


def run_phases(model: Any, num_blocks: int, offloader: Offloader | None = None,
               allow_block_sharing: bool = True, phases: Sequence[str] = tuple(PHASES)) -> PhaseRun:
    """Serve ``phases`` (default A, B, C) one request at a time in one engine session."""
    gen, cb = cb_configs(num_blocks, allow_block_sharing)
    outputs: dict[str, tuple[list[int], list[float]]] = {}
    forward: dict[str, int] = {}
    stats: dict[str, Any] = {}
    errors: list[str] = []
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   warmup=False) as manager:
        for phase in phases:
            prompts = PHASES[phase]
            with count_forward_tokens(model) as count:
                for i, prompt in enumerate(prompts):
                    result = serve(manager, prompt)
                    if result.error is not None:
                        errors.append(f"{phase}{i}: {result.error}")
                    outputs[f"{phase}{i}"] = (list(result.generated_tokens), list(result.logprobs))
            forward[phase] = count[0]
            stats[phase] = offloader.stats() if offloader is not None else None
    return PhaseRun(outputs, forward, stats, errors)


def generate_reference(model: Any, prompt: Sequence[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from plain ``model.generate`` (no continuous batching)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(ids, generation_config=gen)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(logits[0].float(), -1)[t]) for logits, t in zip(out.logits, tokens)]
    return tokens, logprobs


class FailingLoads:
    """A worker that fails its first ``count`` load jobs after writing random bytes into their device
    blocks (what a torn copy could leave), or, with ``report_failure=False``, reports them as
    successful (the control: then the random bytes reach the model)."""

    def __init__(self, worker: kvoffload.Worker, count: int = 1, report_failure: bool = True) -> None:
        self.worker = worker
        self.remaining = count
        self.report_failure = report_failure
        self.broken: dict[int, list[int]] = {}

    def store(self, job_id: int, device_blocks: Sequence[int], host_blocks: Sequence[int], *,
              stream: object = None) -> None:
        self.worker.store(job_id, device_blocks, host_blocks, stream=stream)

    def load(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
             stream: object = None) -> None:
        self.worker.load(job_id, host_blocks, device_blocks, stream=stream)
        if self.remaining > 0:
            self.remaining -= 1
            self.broken[job_id] = list(device_blocks)

    def load_by_layer(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
                      stream: object = None) -> LayerWaiter:
        return self.worker.load_by_layer(job_id, host_blocks, device_blocks, stream=stream)

    def load_from_disk(self, job_id: int, disk_blocks: Sequence[int], device_blocks: Sequence[int], *,
                       stream: object = None, keys: Sequence[bytes] | None = None) -> None:
        self.worker.load_from_disk(job_id, disk_blocks, device_blocks, stream=stream, keys=keys)

    def demote(self, job_id: int, host_blocks: Sequence[int], disk_blocks: Sequence[int], *,
               keys: Sequence[bytes] | None = None) -> None:
        self.worker.demote(job_id, host_blocks, disk_blocks, keys=keys)

    def disk_valid_blocks(self) -> Mapping[int, kvoffload.DiskRecord]:
        return self.worker.disk_valid_blocks()

    def poll(self) -> list[kvoffload.TransferResult]:
        return self.worker.poll()

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[kvoffload.TransferResult]:
        results = []
        for result in self.worker.wait(job_ids, timeout):
            blocks = self.broken.pop(result.job_id, None)
            if blocks is not None:
                layout = self.worker.layout
                noise = torch.randint(0, 256, (len(blocks), layout.record_bytes), dtype=torch.uint8)
                layout.scatter_records(blocks, noise)
                if layout.device.type == "cuda":  # written on this thread's stream: done before use
                    torch.cuda.synchronize(layout.device)
                if self.report_failure:
                    result = attrs.evolve(result, ok=False, error=kvoffload.TransferError("injected"))
            results.append(result)
        return results

    def shutdown(self, timeout: float = 30.0) -> None:
        self.worker.shutdown(timeout)


class UnpolledStores(FailingLoads):
    """A worker whose ``poll`` never returns a finished store: only ``wait`` does (as if every store
    were still in flight whenever the scheduler looks), so the blocks they hold stay held."""

    def __init__(self, worker: kvoffload.Worker) -> None:
        super().__init__(worker, count=0)
        self.hidden: dict[int, kvoffload.TransferResult] = {}
        self.waited_stores = 0

    def poll(self) -> list[kvoffload.TransferResult]:
        results = []
        for result in self.worker.poll():
            if result.direction is kvoffload.Direction.STORE:
                self.hidden[result.job_id] = result
            else:
                results.append(result)
        return results

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[kvoffload.TransferResult]:
        ids = list(job_ids)
        found = {j: self.hidden.pop(j) for j in ids if j in self.hidden}
        self.waited_stores += len(found)
        rest = [j for j in ids if j not in found]
        if rest:
            found.update({r.job_id: r for r in self.worker.wait(rest, timeout)})
        return [found[j] for j in ids]


class LateLoads(FailingLoads):
    """A worker whose first (host, or with ``from_disk`` disk) load is reported late: ``wait`` for
    it raises ``WaitTimeoutError`` (the copy itself completes, and its result comes from a later
    ``poll``)."""

    def __init__(self, worker: kvoffload.Worker, from_disk: bool = False) -> None:
        super().__init__(worker, count=0)
        self.from_disk = from_disk
        self.late: int | None = None
        self.late_results: list[kvoffload.TransferResult] = []

    def load(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
             stream: object = None) -> None:
        self.worker.load(job_id, host_blocks, device_blocks, stream=stream)
        if self.late is None and not self.from_disk:
            self.late = job_id

    def load_from_disk(self, job_id: int, disk_blocks: Sequence[int], device_blocks: Sequence[int], *,
                       stream: object = None, keys: Sequence[bytes] | None = None) -> None:
        self.worker.load_from_disk(job_id, disk_blocks, device_blocks, stream=stream, keys=keys)
        if self.late is None and self.from_disk:
            self.late = job_id

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[kvoffload.TransferResult]:
        if self.late is not None and self.late in job_ids:
            raise kvoffload.WaitTimeoutError(f"job(s) [{self.late}] did not finish (injected)", pending=[self.late])
        return self.worker.wait(job_ids, timeout)

    def poll(self) -> list[kvoffload.TransferResult]:
        results = self.worker.poll()
        self.late_results += [r for r in results if r.job_id == self.late]
        return results


class RefusedLayered(FailingLoads):
    """A worker that refuses its first layer-by-layer load at submit (a typed error, nothing copied)."""

    def __init__(self, worker: kvoffload.Worker) -> None:
        super().__init__(worker, count=0)
        self.refused = 0

    def load_by_layer(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
                      stream: object = None) -> LayerWaiter:
        if self.refused == 0:
            self.refused += 1
            raise kvoffload.BlockConflictError(f"load job {job_id}: refused (injected)")
        return self.worker.load_by_layer(job_id, host_blocks, device_blocks, stream=stream)


class FailedLayered(FailingLoads):
    """A worker whose first layer-by-layer load copies as usual but reports ``ok=False`` (as if a
    copy had failed on the device after the engine's step read the blocks)."""

    def __init__(self, worker: kvoffload.Worker) -> None:
        super().__init__(worker, count=0)
        self.failed: int | None = None

    def load_by_layer(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
                      stream: object = None) -> LayerWaiter:
        if self.failed is None:
            self.failed = job_id
        return self.worker.load_by_layer(job_id, host_blocks, device_blocks, stream=stream)

    def _fail(self, results: list[kvoffload.TransferResult]) -> list[kvoffload.TransferResult]:
        return [attrs.evolve(r, ok=False, error=kvoffload.TransferError("injected")) if r.job_id == self.failed
                else r for r in results]

    def poll(self) -> list[kvoffload.TransferResult]:
        return self._fail(self.worker.poll())

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[kvoffload.TransferResult]:
        return self._fail(self.worker.wait(job_ids, timeout))


class _LateHandle:
    """The handle of a :class:`DelayedLayers` load: waits for the real handle, then for the layer
    (or, as the control, for nothing)."""

    def __init__(self, ordered: bool) -> None:
        self.ordered = ordered
        self.submitted = threading.Event()
        self.real: LayerWaiter | None = None
        self.waits: list[int] = []

    def wait_layer(self, layer: int, stream: object = None) -> None:
        self.waits.append(layer)
        if not self.ordered:
            return
        if not self.submitted.wait(RESULT_TIMEOUT_S):
            raise kvoffload.WaitTimeoutError("the delayed load was never submitted")
        assert self.real is not None
        self.real.wait_layer(layer, stream)


class DelayedLayers(FailingLoads):
    """A worker whose layer-by-layer loads start ``delay`` seconds late (on a thread of their own),
    so that a forward that does not wait for them reads blocks the copy has not written yet. With
    ``ordered=False`` (the control) ``wait_layer`` returns at once."""

    def __init__(self, worker: kvoffload.Worker, delay: float = 0.5, ordered: bool = True) -> None:
        super().__init__(worker, count=0)
        self.delay = delay
        self.ordered = ordered
        self.handles: dict[int, _LateHandle] = {}
        self.threads: list[threading.Thread] = []

    def load_by_layer(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
                      stream: object = None) -> LayerWaiter:
        handle = _LateHandle(self.ordered)
        src, dst = list(host_blocks), list(device_blocks)

        def submit() -> None:
            time.sleep(self.delay)
            handle.real = self.worker.load_by_layer(job_id, src, dst, stream=stream)
            handle.submitted.set()

        self.handles[job_id] = handle
        thread = threading.Thread(target=submit, name=f"delayed-load-{job_id}")
        self.threads.append(thread)
        thread.start()
        return handle

    def _submitted(self, job_ids: Sequence[int]) -> None:
        for j in job_ids:
            handle = self.handles.get(j)
            if handle is not None and not handle.submitted.wait(RESULT_TIMEOUT_S):
                raise kvoffload.WaitTimeoutError(f"the delayed load {j} was never submitted", pending=[j])

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[kvoffload.TransferResult]:
        self._submitted(job_ids)
        return self.worker.wait(job_ids, timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        for thread in self.threads:
            thread.join(RESULT_TIMEOUT_S)
        self.worker.shutdown(timeout)

