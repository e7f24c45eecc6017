"""GPU suite fixtures: skip (with the reason) when no CUDA device is present, and collect the figures
tests measure so that the run ends with one table of them (reported, never asserted)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch

_FIGURES: list[tuple[str, str]] = []


_HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this directory's tests as GPU tests, and skip them (with the reason) without CUDA; tests
    collected from elsewhere in the same session are left alone."""
    skip = pytest.mark.skip(reason="no CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if _HERE not in item.path.resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(skip)


class Figures:
    """Measured figures a test reports; printed together at the end of the session."""

    def add(self, name: str, value: str) -> None:
        _FIGURES.append((name, value))


@pytest.fixture(scope="session")
def figures() -> Figures:
    return Figures()


@pytest.fixture
def device() -> Iterator[torch.device]:
    dev = torch.device("cuda", torch.cuda.current_device())
    yield dev
    torch.cuda.synchronize(dev)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("kvoffload figures (measured, not asserted)")
    for name, value in _FIGURES:
        terminalreporter.write_line(f"{name:<60} {value}")
