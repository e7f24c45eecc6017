"""``python -m kvoffload <command> [options]`` (also the ``kvoffload`` script): the command table.

Commands:
  demo           store and reload a synthetic KV cache through a Worker, verify every byte, report
                 GB/s next to the link limit (host backend, and says so, when there is no GPU)
  bench          every transfer path side by side with the link limit (needs a GPU); ``--disk DIR``:
                 the disk tier against raw O_DIRECT; ``--latency``/``--layerwise``: what one job
                 costs, call to result, and a layer-by-layer load under a synthetic prefill;
                 ``--ranks N``: a host pool shared by N rank processes; ``--remote mooncake|redis``:
                 the remote tier's put/get through kvoffload against the store's own client
  replay         an engine-shaped workload through Manager + Worker; every loaded byte verified;
                 ``--remote mooncake|redis``: two engine instances sharing hits through the store
  manager-bench  per-block cost of the scheduler-side manager at 10k and 1M blocks
  engine-demo    transformers' continuous batching with and without kvoffload: time to first token,
                 prompt tokens recomputed, decode tokens/s, identical tokens (extra "transformers")

The tools live in :mod:`kvoffload.cli` (which uses the public API only, like an integrator's code
would); the engine demo lives with its adapter in :mod:`kvoffload.integrations`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from kvoffload.cli import bench, demo, manager_bench, replay

__all__ = ["main"]


def _engine_demo(argv: Sequence[str]) -> int:
    from kvoffload.integrations import transformers_demo  # imports transformers only when run

    return transformers_demo.main(argv)


_COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "demo": (demo.main, "store and reload a synthetic KV cache, verify every byte, report speed"),
    "bench": (bench.main, "every transfer path side by side with the link limit, bytes checked"),
    "replay": (replay.main, "engine-shaped workload through Manager + Worker, every loaded byte verified"),
    "manager-bench": (lambda argv: manager_bench.main(list(argv)), "per-block cost of the scheduler-side manager"),
    "engine-demo": (_engine_demo, "transformers' continuous batching with and without kvoffload"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command; returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        out = sys.stdout if args else sys.stderr  # no command is a usage error
        print("usage: python -m kvoffload <command> [options]\n\ncommands:", file=out)
        for name, (_, summary) in _COMMANDS.items():
            print(f"  {name:<14} {summary}", file=out)
        return 0 if args else 2
    command = _COMMANDS.get(args[0])
    if command is None:
        print(f"python -m kvoffload: unknown command {args[0]!r} (try --help)", file=sys.stderr)
        return 2
    return command[0](args[1:])


if __name__ == "__main__":
    sys.exit(main())
