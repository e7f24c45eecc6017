"""The vLLM adapter's parts that need no vLLM: options, version pin, chunk sizing, record mapping.

The adapter itself runs against vLLM's scheduler and connector in ``tests/integration/vllm`` (its
own environment); these checks run with the core suite.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import numpy as np
import pytest

from kvoffload import InvalidArgumentError, KVOffloadError, TransferError
from kvoffload.integrations.vllm_support import (
    DEFAULT_TRANSFER_RETRIES,
    DEFAULT_WAIT_TIMEOUT_S,
    SUPPORTED_VLLM_VERSIONS,
    AdapterOptions,
    UnsupportedVLLMFeatureError,
    UnsupportedVLLMVersionError,
    VLLMConfigError,
    VLLMTransferError,
    check_parallel_layout,
    check_vllm_version,
    group_page_bytes,
    job_records,
    num_host_chunks,
    record_bytes_estimate,
)

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kvoffload"


def test_supported_versions_pass_and_others_are_refused_naming_both() -> None:
    for version in SUPPORTED_VLLM_VERSIONS:
        check_vllm_version(version)
        check_vllm_version(version + "+cu130")
    with pytest.raises(UnsupportedVLLMVersionError, match=r"vllm 0\.34\.0 is not supported.*0\.33\.0"):
        check_vllm_version("0.34.0")
    assert issubclass(UnsupportedVLLMVersionError, (ImportError, KVOffloadError))


def test_options_defaults_and_values() -> None:
    options = AdapterOptions.from_extra_config({"host_bytes": 1 << 30, "spec_name": "KVOffloadSpec"})
    assert options == AdapterOptions(1 << 30, "lru", DEFAULT_TRANSFER_RETRIES, DEFAULT_WAIT_TIMEOUT_S)
    options = AdapterOptions.from_extra_config(
        {"host_bytes": 4096, "eviction_policy": "arc", "transfer_retries": 0, "wait_timeout_s": 2}
    )
    assert (options.eviction_policy, options.transfer_retries, options.wait_timeout_s) == ("arc", 0, 2.0)
    assert options.expedited_loads is True
    assert AdapterOptions.from_extra_config({"host_bytes": 1, "expedited_loads": False}).expedited_loads is False


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({}, VLLMConfigError, "has no 'host_bytes'"),
        ({"host_bytes": "1G"}, VLLMConfigError, r"\['host_bytes'\] = '1G' must be a positive int"),
        ({"host_bytes": True}, VLLMConfigError, "must be a positive int"),
        ({"host_bytes": 0}, VLLMConfigError, "must be a positive int"),
        ({"host_bytes": 1, "eviction_policy": "mru"}, VLLMConfigError, r"'mru' is not one of"),
        ({"host_bytes": 1, "transfer_retries": -1}, VLLMConfigError, "must be an int >= 0"),
        ({"host_bytes": 1, "wait_timeout_s": float("inf")}, VLLMConfigError, "finite"),
        ({"host_bytes": 1, "attach_timeout_s": 0}, VLLMConfigError, r"\['attach_timeout_s'\] = 0 must be"),
        ({"host_bytes": 1, "canonical_layout": True}, UnsupportedVLLMFeatureError, "direct layout"),
        ({"host_bytes": 1, "disk_path": "/x"}, UnsupportedVLLMFeatureError, "disk tier"),
        ({"cpu_bytes_to_use": 1}, UnsupportedVLLMFeatureError, "CPUOffloadingSpec"),
        ({"host_bytes": 1, "store_threshold": 3}, UnsupportedVLLMFeatureError, "store_threshold"),
        ({"host_bytes": 1, "cache_policy_module_path": "m"}, UnsupportedVLLMFeatureError, "module path"),
        ({"host_bytes": 1, "evicton_policy": "arc"}, VLLMConfigError,
         r"\['evicton_policy'\] is not an option of KVOffloadSpec; did you mean 'eviction_policy'"),
        ({"host_byte": 1 << 30}, VLLMConfigError, "did you mean 'host_bytes'"),
        ({"host_bytes": 1, "wait_timeout": 5}, VLLMConfigError, "did you mean 'wait_timeout_s'"),
        ({"host_bytes": 1, "eviction_policy": ["lru"]}, VLLMConfigError, r"\['lru'\] is not one of"),
        ({"host_bytes": 1, "wait_timeout_s": 10**400}, VLLMConfigError, "finite number of seconds"),
        ({"host_bytes": 1, "expedited_loads": 1}, VLLMConfigError, r"\['expedited_loads'\] = 1 must be true or false"),
        ({"host_bytes": 1, "expedited_load": True}, VLLMConfigError, "did you mean 'expedited_loads'"),
    ],
)
def test_bad_or_unsupported_options_are_refused_naming_the_key(
    extra: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        AdapterOptions.from_extra_config(extra)
    assert issubclass(error, InvalidArgumentError)


def test_options_vllm_leaves_harmless_are_accepted() -> None:
    AdapterOptions.from_extra_config({"host_bytes": 1, "store_threshold": 1, "canonical_layout": False})
    # vLLM's own keys, far from every option of the adapter, are left to vLLM
    AdapterOptions.from_extra_config({"host_bytes": 1, "block_size": 64, "spec_name": "KVOffloadSpec",
                                      "spec_module_path": "kvoffload.integrations.vllm",
                                      "blocks_per_chunk": 4})


def test_chunk_count_uses_padded_records_of_every_block_of_a_chunk() -> None:
    assert record_bytes_estimate(4096) == 4096 and record_bytes_estimate(4097) == 8192
    assert num_host_chunks(10 * 8192, 5000, 2) == 5
    with pytest.raises(VLLMConfigError, match="holds no chunk"):
        num_host_chunks(8191, 5000, 2)
    with pytest.raises(UnsupportedVLLMFeatureError, match="no offloadable bytes"):
        num_host_chunks(1 << 20, 0, 1)
    assert num_host_chunks(4096 << 31, 4096, 1) == 1 << 31  # the most a pool may have
    # 10 PiB (extra digits) named as host_bytes (kvoffload's Manager refused the block count,
    # naming no key of the config: found by an audit)
    with pytest.raises(VLLMConfigError, match=r"\['host_bytes'\] = 11258999068426240 makes"):
        num_host_chunks(10 << 50, 4096, 1)


def test_tensor_parallelism_alone_is_accepted_and_other_parallel_layouts_are_refused() -> None:
    one = {"world_size": 1, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1}
    check_parallel_layout(**one)
    check_parallel_layout(**{**one, "world_size": 4, "tp_size": 4})  # one shared pool
    for sizes in ({"world_size": 4, "tp_size": 2, "pp_size": 2}, {"world_size": 2, "tp_size": 2, "dcp_size": 2},
                  {"world_size": 2, "tp_size": 1, "pcp_size": 2}):
        with pytest.raises(UnsupportedVLLMFeatureError, match="tensor parallelism alone"):
            check_parallel_layout(**{**one, **sizes})


def test_aligned_chunks_map_to_consecutive_records() -> None:
    gpu, host = job_records([7, 8, 9, 10], [4], [0], [5, 2], blocks_per_chunk=2)
    assert gpu.tolist() == [7, 8, 9, 10] and host.tolist() == [10, 11, 4, 5]
    gpu, host = job_records([3, 4], [2], [6], [1, 0], blocks_per_chunk=1)
    assert host.tolist() == [1, 0]


def test_unaligned_group_skips_the_first_chunks_leading_records() -> None:
    # blocks 1..5 of the request with 4 blocks per chunk: chunk 6 from its second record, chunk 3
    _, host = job_records([20, 21, 22, 23, 24], [5], [1], [6, 3], blocks_per_chunk=4)
    assert host.tolist() == [25, 26, 27, 12, 13]


def test_groups_take_their_chunks_in_order_and_empty_groups_take_none() -> None:
    gpu, host = job_records(
        np.array([1, 2, 3], dtype=np.int32), [2, 0, 1], [2, 0, 5], [4, 9], blocks_per_chunk=2
    )
    assert gpu.tolist() == [1, 2, 3] and host.tolist() == [8, 9, 19]
    gpu, host = job_records([], [0], [0], [], blocks_per_chunk=2)
    assert gpu.size == 0 and host.size == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1, 2], [3], [0], [0, 1], 1), "add up to 3 blocks, but it lists 2"),
        (([1, 2], [2], [0], [0], 1), "group 0 needs 2 host chunk"),
        (([1, 2], [2], [0], [0, 1, 2], 1), "use 2 host chunk.*lists 3"),
        (([1], [1], [0, 0], [0], 1), "1 group sizes but 2 block indices"),
    ],
)
def test_specs_that_do_not_add_up_are_refused(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(VLLMConfigError, match=match):
        job_records(*args)


def test_page_bytes_are_the_largest_unpadded_page_and_every_group_covers_every_tensor() -> None:
    assert group_page_bytes([2048, 1024], [[(0, 1536), (1, 1024)], [(0, 2048), (1, 512)]]) == [2048, 1024]
    with pytest.raises(UnsupportedVLLMFeatureError, match=r"group 1 covers only some.*\[0\]"):
        group_page_bytes([64, 64], [[(0, 64), (1, 64)], [(1, 64)]])
    with pytest.raises(VLLMConfigError, match="references tensor 2"):
        group_page_bytes([64, 64], [[(2, 64)]])
    with pytest.raises(VLLMConfigError, match="does not fit"):
        group_page_bytes([64], [[(0, 128)]])
    with pytest.raises(UnsupportedVLLMFeatureError, match="at least one"):
        group_page_bytes([], [])


def test_transfer_error_carries_vllms_job_id() -> None:
    error = VLLMTransferError("store failed", 17)
    assert error.job_id == 17 and isinstance(error, TransferError)


def _imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", sorted((PACKAGE / "integrations").glob("*.py")), ids=lambda p: p.stem)
def test_integrations_use_only_the_public_surface(path: pathlib.Path) -> None:
    allowed = {"kvoffload", "kvoffload.testing"}
    if path.name == "transformers_demo.py":  # a command too: it checks its flags with the tools' helpers
        allowed.add("kvoffload.cli._args")
    for module in _imports(path):
        if module.startswith("kvoffload") and not module.startswith("kvoffload.integrations"):
            assert module in allowed, f"{path.name} imports {module}, which is not public"


@pytest.mark.parametrize(
    "path", sorted(p for p in PACKAGE.glob("*.py") if p.stem != "__main__"), ids=lambda p: p.stem
)
def test_the_core_never_imports_an_integration(path: pathlib.Path) -> None:
    """The core, not the command table (``__main__`` runs the transformers adapter's demo)."""
    bad = {m for m in _imports(path) if m.startswith("kvoffload.integrations") or m == "vllm"}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_readme_kv_transfer_config_is_valid_json_the_adapter_accepts() -> None:
    import json
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## Use with vLLM", 1)[1]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block is not None, "the vLLM section has no json block"
    config = json.loads(block.group(1))
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == ("KVOffloadSpec", "kvoffload.integrations.vllm")
    AdapterOptions.from_extra_config(extra)
