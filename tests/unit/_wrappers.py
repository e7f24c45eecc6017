"""The base of the contract tests' broken workers (CPU and GPU): an engine's wrapper over a real
worker, delegating everything; each broken one overrides what it breaks."""

from __future__ import annotations

from typing import Any

from kvoffload import Worker


class Wrapper:
    """An engine's wrapper over a real worker, delegating everything (the broken ones override)."""

    def __init__(self, inner: Worker) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> Wrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.shutdown()
