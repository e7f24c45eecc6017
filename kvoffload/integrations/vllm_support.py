"""The parts of the vLLM adapter that do not import vLLM: version pin, options, record mapping, errors.

:mod:`kvoffload.integrations.vllm` builds on this module; keeping these parts free of vLLM lets an
engine's CI (and kvoffload's own CPU suite) check them without installing vLLM.

How offloaded chunks map onto host records: vLLM offloads *chunks* of ``blocks_per_chunk``
consecutive GPU blocks of one request and one KV cache group, and names each chunk by an
``OffloadKey``. The scheduler-side :class:`kvoffload.Manager` hands out one host block per chunk
(``num_chunks`` of them); the worker's host pool holds ``blocks_per_chunk`` consecutive host
records per chunk, so GPU block ``j`` of chunk ``c`` lives in record ``c * blocks_per_chunk + j``.
A transfer whose first GPU block of a group is not chunk-aligned (vLLM's ``block_indices``) starts
inside that group's first chunk; :func:`job_records` skips the leading records accordingly.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload import MAX_TIER_BLOCKS, InvalidArgumentError, KVOffloadError, TransferError

__all__ = [
    "DEFAULT_ATTACH_TIMEOUT_S",
    "DEFAULT_TRANSFER_RETRIES",
    "DEFAULT_WAIT_TIMEOUT_S",
    "RECORD_ALIGN_BYTES",
    "SUPPORTED_VLLM_VERSIONS",
    "AdapterOptions",
    "UnsupportedVLLMFeatureError",
    "UnsupportedVLLMVersionError",
    "VLLMConfigError",
    "VLLMIntegrationError",
    "VLLMTransferError",
    "check_parallel_layout",
    "check_vllm_version",
    "group_page_bytes",
    "job_records",
    "num_host_chunks",
    "record_bytes_estimate",
]

#: The vLLM releases whose offloading-spec interface this adapter implements and was tested with.
#: vLLM marks that interface experimental, so any other version is refused at import.
SUPPORTED_VLLM_VERSIONS: Final = ("0.33.0",)
#: A failed store or load is resubmitted this many times before it is reported as an engine error.
DEFAULT_TRANSFER_RETRIES: Final = 1
#: vLLM's ``wait(job_ids)`` has no deadline; the adapter gives it this one (seconds).
DEFAULT_WAIT_TIMEOUT_S: Final = 300.0
#: How long a tensor-parallel rank's worker waits for the others to map the shared pool, by default
#: (the ``SharedPool`` default: ranks start within seconds, pinning a large pool takes tens).
DEFAULT_ATTACH_TIMEOUT_S: Final = 300.0
#: The host record of one GPU block is padded to a multiple of this (as kvoffload pads every record).
RECORD_ALIGN_BYTES: Final = 4096

_POLICIES: Final = ("lru", "arc")
#: extra_config keys this adapter reads.
_KNOWN_KEYS: Final = (
    "host_bytes", "eviction_policy", "transfer_retries", "wait_timeout_s", "attach_timeout_s",
    "expedited_loads",
)
#: How close (difflib's ratio) an unknown key must be to one of the adapter's to be refused as a
#: misspelling of it.
_MISSPELLED_CUTOFF: Final = 0.8
#: extra_config keys of vLLM's own CPU spec, or kvoffload features, that this adapter does not
#: support yet, with the reason given to the user.
_REFUSED_KEYS: Final = {
    "cpu_bytes_to_use": "it is the option of vLLM's CPUOffloadingSpec; give the host pool size as "
    "host_bytes",
    "store_threshold": "store admission by reuse count is not implemented by kvoffload's manager",
    "cache_policy_module_path": "out-of-tree eviction policies are not loaded from a module path; "
    "choose eviction_policy 'lru' or 'arc'",
    "disk_path": "the disk tier is not supported by the vLLM adapter yet (host tier only)",
    "disk_bytes": "the disk tier is not supported by the vLLM adapter yet (host tier only)",
}

I64Array = npt.NDArray[np.int64]


class VLLMIntegrationError(KVOffloadError):
    """Base class of the errors the vLLM adapter raises on purpose."""


class UnsupportedVLLMVersionError(VLLMIntegrationError, ImportError):
    """Raised when :mod:`kvoffload.integrations.vllm` is imported with a vLLM version the adapter
    does not support (see :data:`SUPPORTED_VLLM_VERSIONS`). The message names the installed version
    and the supported ones. It is also an ``ImportError``: the adapter module did not load."""


class VLLMConfigError(VLLMIntegrationError, InvalidArgumentError):
    """Raised when ``kv_connector_extra_config`` holds a missing or bad adapter option. The message
    names the key, the value and the rule. Raised when the spec is built, before anything is
    allocated."""


class UnsupportedVLLMFeatureError(VLLMIntegrationError, InvalidArgumentError):
    """Raised when vLLM asks for something this adapter does not support yet, named in the message:
    the canonical host layout, pipeline or context parallelism (tensor parallelism alone is
    supported), a KV cache group that covers only some of the KV tensors, the disk tier, or an
    option of vLLM's own CPU spec. Raised when the spec, manager or worker is built, before anything
    is allocated."""


class VLLMTransferError(VLLMIntegrationError, TransferError):
    """Raised by the adapter's worker when a store or load failed on every attempt, or when vLLM's
    ``wait`` passed the adapter's deadline. vLLM's connector cannot take a failed job (it asserts
    that every job succeeds), so the adapter stops the engine with this error instead: a failed
    store is never reported as done, so its keys never become loadable; a failed load never lets
    the request run on undefined KV. ``job_id`` is vLLM's job id; ``__cause__`` is kvoffload's
    error for the last attempt."""

    def __init__(self, message: str, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(message)


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVLLMVersionError` unless ``version`` is in
    :data:`SUPPORTED_VLLM_VERSIONS` (compared after dropping a local ``+suffix``, e.g. ``+cu130``)."""
    release = version.split("+", 1)[0]
    if release not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVLLMVersionError(
            f"vllm {version} is not supported by kvoffload.integrations.vllm: it implements the "
            f"offloading-spec interface of vllm {', '.join(SUPPORTED_VLLM_VERSIONS)} (vLLM marks "
            "that interface experimental; install a supported version, e.g. "
            f"pip install vllm=={SUPPORTED_VLLM_VERSIONS[-1]})"
        )


@attrs.frozen
class AdapterOptions:
    """The adapter's options, read from vLLM's ``kv_connector_extra_config``.

    Attributes:
        host_bytes: the host pool's budget in bytes (``host_bytes``, required), every rank's slices
            together: the pool holds ``host_bytes // (world_size * blocks_per_chunk * record
            bytes)`` chunks.
        eviction_policy: ``"lru"`` (default) or ``"arc"``.
        transfer_retries: how many times a failed store or load is resubmitted before the engine is
            stopped with :class:`VLLMTransferError` (default 1).
        wait_timeout_s: the deadline the adapter gives vLLM's ``wait`` (default 300 s).
        attach_timeout_s: with tensor parallelism, how long a rank's worker waits for the other
            ranks to map the shared pool (default 300 s).
        expedited_loads: give the loads vLLM waits for within a step (``expedited``) a second load
            lane, so that they never queue behind the regular loads in the library (default
            True; it costs the lane's backend: on CUDA its streams, its issuer thread and, where
            its path stages, a staging ring of 32 MiB; its loads of up to 8 MiB go through ``sm``,
            which no copy engine holds behind the regular lane's copies: docs/design.md §4).
            False: they share the regular lane.
    """

    host_bytes: int
    eviction_policy: str = "lru"
    transfer_retries: int = DEFAULT_TRANSFER_RETRIES
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    attach_timeout_s: float = DEFAULT_ATTACH_TIMEOUT_S
    expedited_loads: bool = True

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, object]) -> AdapterOptions:
        """Read and check the adapter's keys; other keys (vLLM's own) are left to vLLM.

        Raises:
            VLLMConfigError: ``host_bytes`` missing or not a positive int; an unknown policy; a
                negative or non-int ``transfer_retries``; a non-positive ``wait_timeout_s`` or
                ``attach_timeout_s``; an ``expedited_loads`` that is not a bool; a key close to
                one of the adapter's (a misspelling).
            UnsupportedVLLMFeatureError: a key this adapter refuses (``canonical_layout`` true,
                ``cpu_bytes_to_use``, ``store_threshold`` >= 2, ``cache_policy_module_path``,
                ``disk_path``, ``disk_bytes``), naming the key and why.
        """
        if not isinstance(extra_config, Mapping):
            raise VLLMConfigError(
                f"kv_connector_extra_config is a {type(extra_config).__name__}; it must be a mapping"
            )
        for key, reason in _REFUSED_KEYS.items():
            value = extra_config.get(key)
            if value is None or (key == "store_threshold" and _below_two(value)):
                continue
            raise UnsupportedVLLMFeatureError(
                f"kv_connector_extra_config[{key!r}] = {value!r} is not supported by KVOffloadSpec: "
                f"{reason}"
            )
        _check_misspelled(extra_config)
        if extra_config.get("canonical_layout"):
            raise UnsupportedVLLMFeatureError(
                "kv_connector_extra_config['canonical_layout'] = "
                f"{extra_config['canonical_layout']!r} is not supported by KVOffloadSpec: it stores "
                "each rank's slices in vLLM's direct layout, not the canonical one"
            )
        if "host_bytes" not in extra_config:
            raise VLLMConfigError(
                "kv_connector_extra_config has no 'host_bytes': give the host pool's size in bytes, "
                'e.g. "host_bytes": 17179869184 for 16 GiB'
            )
        host_bytes = extra_config["host_bytes"]
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes <= 0:
            raise VLLMConfigError(
                f"kv_connector_extra_config['host_bytes'] = {host_bytes!r} must be a positive int "
                "(bytes)"
            )
        policy = extra_config.get("eviction_policy", "lru")
        if not isinstance(policy, str) or policy not in _POLICIES:
            raise VLLMConfigError(
                f"kv_connector_extra_config['eviction_policy'] = {policy!r} is not one of "
                f"{list(_POLICIES)}"
            )
        retries = extra_config.get("transfer_retries", DEFAULT_TRANSFER_RETRIES)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise VLLMConfigError(
                f"kv_connector_extra_config['transfer_retries'] = {retries!r} must be an int >= 0"
            )
        expedited = extra_config.get("expedited_loads", True)
        if not isinstance(expedited, bool):
            raise VLLMConfigError(
                f"kv_connector_extra_config['expedited_loads'] = {expedited!r} must be true or false"
            )
        return cls(
            host_bytes=host_bytes,
            eviction_policy=str(policy),
            transfer_retries=retries,
            wait_timeout_s=_seconds(extra_config, "wait_timeout_s", DEFAULT_WAIT_TIMEOUT_S),
            attach_timeout_s=_seconds(extra_config, "attach_timeout_s", DEFAULT_ATTACH_TIMEOUT_S),
            expedited_loads=expedited,
        )


def _check_misspelled(extra_config: Mapping[str, object]) -> None:
    """Refuse a key that is none of this adapter's but close to one (``evicton_policy``): read as
    vLLM's own, it would leave the adapter's option at its default without a word. Keys far from
    every option are left to vLLM (its own, e.g. ``block_size``, ``spec_name``).

    Raises:
        VLLMConfigError: naming the key and the option it is close to.
    """
    ours = (*_KNOWN_KEYS, *_REFUSED_KEYS, "canonical_layout")
    for key in extra_config:
        if not isinstance(key, str) or key in ours:
            continue
        close = difflib.get_close_matches(key, ours, n=1, cutoff=_MISSPELLED_CUTOFF)
        if close:
            raise VLLMConfigError(
                f"kv_connector_extra_config[{key!r}] is not an option of KVOffloadSpec; did you mean "
                f"{close[0]!r}? (keys far from every option are left to vLLM)"
            )


def _seconds(extra_config: Mapping[str, object], key: str, default: float) -> float:
    """``extra_config[key]`` (else ``default``) as a finite number of seconds > 0, or
    :class:`VLLMConfigError` naming the key."""
    value = extra_config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= threading.TIMEOUT_MAX:
        raise VLLMConfigError(
            f"kv_connector_extra_config[{key!r}] = {value!r} must be a finite number of seconds > 0"
        )
    return float(value)


def _below_two(value: object) -> bool:
    """A ``store_threshold`` below 2 turns admission filtering off in vLLM: nothing to refuse."""
    return isinstance(value, int) and not isinstance(value, bool) and value < 2


def record_bytes_estimate(kv_bytes_per_block: int) -> int:
    """The host record size of a GPU block of ``kv_bytes_per_block`` bytes: the bytes rounded up to
    :data:`RECORD_ALIGN_BYTES`. The scheduler sizes the pool with it (it has no tensors to build a
    layout from); the worker checks its layout's record size against it."""
    return -(-kv_bytes_per_block // RECORD_ALIGN_BYTES) * RECORD_ALIGN_BYTES


def num_host_chunks(host_bytes: int, kv_bytes_per_block: int, blocks_per_chunk: int) -> int:
    """How many chunks a pool of ``host_bytes`` holds: ``host_bytes`` over the chunk's records.

    The scheduler and every worker compute it from the same config, so they agree on the chunk
    ids. Raises :class:`VLLMConfigError` when the budget holds no chunk or more chunks than a pool
    may have (``MAX_TIER_BLOCKS``), or
    :class:`UnsupportedVLLMFeatureError` when vLLM reports no KV bytes per block (a layout with no
    offloadable KV).
    """
    if kv_bytes_per_block <= 0:
        raise UnsupportedVLLMFeatureError(
            f"vLLM reports worker_kv_bytes_per_block = {kv_bytes_per_block}: this KV cache layout "
            "has no offloadable bytes per block that KVOffloadSpec can size a host pool for"
        )
    chunk_bytes = record_bytes_estimate(kv_bytes_per_block) * blocks_per_chunk
    chunks = host_bytes // chunk_bytes
    if chunks < 1:
        raise VLLMConfigError(
            f"kv_connector_extra_config['host_bytes'] = {host_bytes} holds no chunk: one chunk of "
            f"{blocks_per_chunk} block(s) takes {chunk_bytes} bytes of host records"
        )
    if chunks > MAX_TIER_BLOCKS:
        raise VLLMConfigError(
            f"kv_connector_extra_config['host_bytes'] = {host_bytes} makes {chunks} chunks of "
            f"{chunk_bytes} bytes, over the most a pool may have ({MAX_TIER_BLOCKS}): is it a size "
            "in bytes with extra digits?"
        )
    return chunks


def check_parallel_layout(*, world_size: int, tp_size: int, pp_size: int, pcp_size: int, dcp_size: int) -> None:
    """Accept one worker per engine, or tensor parallelism alone (``world_size == tp_size``: the
    ranks share one kvoffload host pool, each rank's slice of a block beside the others', in rank
    order). Refuse pipeline and context parallelism (the ranks' records would differ in size or
    meaning). Raises :class:`UnsupportedVLLMFeatureError` naming what was asked."""
    if (pp_size, pcp_size, dcp_size) != (1, 1, 1) or world_size != tp_size:
        raise UnsupportedVLLMFeatureError(
            f"vLLM runs {world_size} worker processes for this engine with tensor parallel size "
            f"{tp_size}, pipeline {pp_size}, prefill context {pcp_size}, decode context {dcp_size}; "
            "KVOffloadSpec supports tensor parallelism alone (world_size == tp_size, the others 1): "
            "one shared host pool whose blocks hold every rank's slice"
        )


def group_page_bytes(
    tensor_page_bytes: Sequence[int], groups: Sequence[Sequence[tuple[int, int]]]
) -> list[int]:
    """The bytes of one block to copy from each KV tensor, checking that every group covers them all.

    Args:
        tensor_page_bytes: each tensor's (possibly padded) page size in bytes.
        groups: per KV cache group, the ``(tensor_idx, unpadded_page_bytes)`` of each of its layers.

    Returns the largest unpadded page any layer uses in each tensor (the padding after it is never
    copied).

    Raises:
        UnsupportedVLLMFeatureError: a group does not reference every tensor (one host record holds
            the pages of every tensor, so each group's block must own a page in each), or there is
            no group or no tensor.
        VLLMConfigError: a reference names a tensor that does not exist, or a page larger than
            its tensor's page.
    """
    if not tensor_page_bytes or not groups:
        raise UnsupportedVLLMFeatureError(
            f"vLLM registered {len(tensor_page_bytes)} KV tensor(s) in {len(groups)} group(s); "
            "KVOffloadSpec needs at least one of each"
        )
    pages = [0] * len(tensor_page_bytes)
    everything = set(range(len(tensor_page_bytes)))
    for g, refs in enumerate(groups):
        for idx, page in refs:
            if not 0 <= idx < len(tensor_page_bytes):
                raise VLLMConfigError(
                    f"KV cache group {g} references tensor {idx}, but vLLM registered "
                    f"{len(tensor_page_bytes)} tensor(s)"
                )
            if not 0 < page <= tensor_page_bytes[idx]:
                raise VLLMConfigError(
                    f"KV cache group {g}: a layer's page of {page} bytes does not fit tensor "
                    f"{idx}'s page of {tensor_page_bytes[idx]} bytes"
                )
            pages[idx] = max(pages[idx], page)
        missing = sorted(everything - {idx for idx, _ in refs})
        if missing:
            raise UnsupportedVLLMFeatureError(
                f"KV cache group {g} covers only some of the {len(tensor_page_bytes)} KV tensors "
                f"(not tensor(s) {missing}); KVOffloadSpec supports groups that each cover every "
                "tensor (a host record holds one block's page of every tensor)"
            )
    return pages


def job_records(
    block_ids: Sequence[int] | npt.NDArray[np.integer],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    chunk_ids: Sequence[int] | npt.NDArray[np.integer],
    blocks_per_chunk: int,
) -> tuple[I64Array, I64Array]:
    """Pair each GPU block of a vLLM transfer with its host record (see the module docstring).

    ``block_ids`` lists the GPU blocks group after group (``group_sizes[g]`` of group ``g``, whose
    first block is block ``block_indices[g]`` of the request); ``chunk_ids`` lists the host chunks
    in the same group order. Returns ``(gpu_blocks, host_records)``, co-indexed.

    Raises:
        VLLMConfigError: the lengths do not add up (``sum(group_sizes) != len(block_ids)``, the
            chunks do not cover the groups' blocks, or chunks are left over), naming the numbers.
    """
    blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    chunks = np.asarray(chunk_ids, dtype=np.int64).reshape(-1)
    if len(group_sizes) != len(block_indices):
        raise VLLMConfigError(
            f"the GPU spec has {len(group_sizes)} group sizes but {len(block_indices)} block indices"
        )
    if sum(group_sizes) != blocks.size:
        raise VLLMConfigError(
            f"the GPU spec's group sizes {list(group_sizes)} add up to {sum(group_sizes)} blocks, "
            f"but it lists {blocks.size} block ids"
        )
    per_chunk = np.arange(blocks_per_chunk, dtype=np.int64)
    records: list[I64Array] = []
    chunk_pos = 0
    for g, (size, first) in enumerate(zip(group_sizes, block_indices)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        count = -(-(size + skip) // blocks_per_chunk)
        if chunk_pos + count > chunks.size:
            raise VLLMConfigError(
                f"group {g} needs {count} host chunk(s) from position {chunk_pos}, but the spec "
                f"lists {chunks.size} chunk id(s)"
            )
        rows = (chunks[chunk_pos : chunk_pos + count, None] * blocks_per_chunk + per_chunk).ravel()
        records.append(rows[skip : skip + size])
        chunk_pos += count
    if chunk_pos != chunks.size:
        raise VLLMConfigError(
            f"the groups use {chunk_pos} host chunk(s), but the spec lists {chunks.size}"
        )
    host = np.concatenate(records) if records else np.zeros(0, dtype=np.int64)
    return blocks, host
