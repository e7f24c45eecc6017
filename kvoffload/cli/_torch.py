"""Torch stream and event helpers the tools share (typed: torch's constructors are not)."""

from __future__ import annotations

import torch

__all__ = ["new_event", "new_stream"]


def new_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream from torch's pool (never the legacy default stream)."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def new_event(*, timing: bool) -> torch.cuda.Event:
    """A CUDA event; created by the driver at its first record."""
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]
