"""Command line: ``python -m kvoffload <command> [options]``.

Commands:
  demo    store and reload a synthetic KV cache through a Worker, verify every byte, report GB/s
          next to the link limit (host backend, and says so, when there is no GPU)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from kvoffload import demo

__all__ = ["main"]

_COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "demo": (demo.main, "store and reload a synthetic KV cache, verify every byte, report speed"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command; returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m kvoffload <command> [options]\n\ncommands:")
        for name, (_, summary) in _COMMANDS.items():
            print(f"  {name:<10} {summary}")
        return 0 if args else 2
    command = _COMMANDS.get(args[0])
    if command is None:
        print(f"python -m kvoffload: unknown command {args[0]!r} (try --help)", file=sys.stderr)
        return 2
    return command[0](args[1:])


if __name__ == "__main__":
    sys.exit(main())
