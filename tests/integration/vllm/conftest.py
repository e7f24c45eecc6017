"""Fixtures for the vLLM integration tests: engines that are always shut down.

These tests need vLLM (``pip install --no-deps vllm==0.33.0`` plus its import-time dependencies; see
``.ci/run``), run on CPU and load nothing from a hub: the model config is the one shipped in
``tiny_llama/``, and ``HF_HUB_OFFLINE`` is set before vLLM is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.integration.vllm._runner import EngineRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

#: Every test module starts with this skip (it names what is missing).
VLLM_REASON = "the vLLM integration tests need vllm==0.33.0 (see .ci/run)"

RunnerFactory = Callable[..., "EngineRunner"]


@pytest.fixture
def make_runner() -> Iterator[RunnerFactory]:
    """Build :class:`EngineRunner` objects; each is closed when the test ends."""
    from tests.integration.vllm._runner import EngineRunner

    built: list[EngineRunner] = []

    def make(**kwargs: Any) -> EngineRunner:
        runner = EngineRunner(**kwargs)
        built.append(runner)
        return runner

    yield make
    for runner in built:
        runner.close()
