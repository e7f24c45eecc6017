"""Checks of the tools' flag values, made while the command line is parsed.

The ``type=`` helpers raise :class:`argparse.ArgumentTypeError`, which argparse prints as one line,
``<prog>: error: argument --flag: <message>``, before it exits with status 2: a bad value is refused
before any work is done, with the flag, the value and the rule named. The ``check_*`` functions are
the cross-flag checks a tool runs right after ``parse_args``; they end in ``parser.error`` (the same
line and status). Owns nothing; creates no file.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import torch

from kvoffload import host_memory_available

__all__ = [
    "GIB",
    "check_backend",
    "check_device_memory",
    "check_memory",
    "finite_float",
    "host_port",
    "host_ports",
    "int_in",
    "int_list",
    "names",
    "writable_file",
]

GIB: Final = 1 << 30
T = TypeVar("T")


def _rule(low: float | None, high: float | None, *, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"<= {high}" if high is not None else "a number"


def int_in(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """A ``type=`` for an int in ``[low, high]`` (an open end when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} must be {_rule(low, high)}")
        return value

    return parse


def finite_float(
    low: float | None = None, high: float | None = None, *, low_open: bool = False
) -> Callable[[str], float]:
    """A ``type=`` for a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number {_rule(low, high, low_open=low_open)}")
        return value

    return parse


def names(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A ``type=`` for a comma-separated, non-empty list of names from ``allowed``."""

    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(n for n in text.split(",") if n)
        unknown = [n for n in chosen if n not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(
                f"{text!r} must be a comma-separated list of {', '.join(allowed)}"
                + (f" ({', '.join(map(repr, unknown))} is not)" if unknown else ""))
        return chosen

    return parse


def _each(text: str, one: Callable[[str], T], what: str) -> tuple[T, ...]:
    """``one`` of every item of the comma-separated, non-empty list ``text`` (``what`` says what it
    must be when it is empty)."""
    items = [t for t in text.split(",") if t]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
    try:
        return tuple(one(t) for t in items)
    except argparse.ArgumentTypeError as exc:  # names the item; the list too when it is longer
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}" if len(items) > 1 else str(exc)) from None


def int_list(low: int, high: int) -> Callable[[str], tuple[int, ...]]:
    """A ``type=`` for a comma-separated, non-empty list of ints, each in ``[low, high]``."""
    one = int_in(low, high)
    return lambda text: _each(text, one, "a comma-separated list of integers")


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as ``(host, port)``; a ``type=`` for one address."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    digits = port.isascii() and port.isdigit()
    if not sep or not host or any(c.isspace() for c in host) or not digits or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} must be HOST:PORT (a port in 1..65535)")
    return host, int(port)


def host_ports(text: str) -> tuple[tuple[str, int], ...]:
    """A ``type=`` for ``HOST:PORT,...`` (at least one)."""
    return _each(text, host_port, "HOST:PORT,... (at least one address)")


def writable_file(text: str) -> str:
    """A ``type=`` for a file the tool writes at the end of its run: checked now, so that a run is
    not lost to a path it cannot write; nothing is created here."""
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} must be a file path (not a directory)")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r}: its directory {parent!r} does not exist")
    target = text if os.path.exists(text) else parent
    if not os.access(target, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written (no permission on {target!r})")
    return text


def check_backend(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Refuse ``--backend cuda`` where torch sees no CUDA device, and a ``--path`` other than
    ``auto`` on the host backend; whether the run uses CUDA."""
    if args.backend == "cuda" and not torch.cuda.is_available():
        parser.error("argument --backend: 'cuda' but torch sees no CUDA device (use auto or host)")
    use_cuda: bool = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    if not use_cuda and args.path != "auto":
        parser.error(f"argument --path: {args.path!r} applies to the cuda backend only (this run uses the "
                     "host backend)")
    return use_cuda


def check_memory(parser: argparse.ArgumentParser, needed_bytes: int, what: str, lower: str) -> None:
    """``parser.error`` when ``needed_bytes`` of host memory (``what`` needs them) exceed what this
    process can still populate (:func:`kvoffload.host_memory_available`); ``lower`` names the flags
    that shrink it. No check where that figure is unknown."""
    available = host_memory_available()
    if available is not None and needed_bytes > available[0]:
        parser.error(f"{what} needs {needed_bytes / GIB:.2f} GiB of host memory, {available[0] / GIB:.2f} GiB "
                     f"is available ({available[1]}): lower {lower}")


def check_device_memory(
    parser: argparse.ArgumentParser, device: torch.device, needed_bytes: int, what: str, lower: str
) -> None:
    """:func:`check_memory` for the free memory of CUDA ``device`` (no check on another device)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if needed_bytes > free:
        parser.error(f"{what} needs {needed_bytes / GIB:.2f} GiB of memory on {device}, {free / GIB:.2f} GiB "
                     f"is free: lower {lower}")
