"""``python -m kvoffload replay --remote mooncake|redis``: two engine instances sharing hits.

Instance A (this process) runs the replay with a remote tier: every completed store is written
through to the store, and its lookups past the local tiers load from it. Then instance B — another
process, ``python -m kvoffload replay ... --instance-only``, the same workload (same seed) with an
empty host pool — runs against the same store: the blocks A stored are hits for B, read from the
store into B's host pool, loaded into B's device cache and verified byte for byte like every other
hit. The store's services are started here (Mooncake inside a loopback-only network namespace that
this process enters: root or CAP_SYS_ADMIN; a 3-node Redis Cluster on 127.0.0.1) unless
``--remote-address`` names running ones, and stopped by their process ids at the end. The exit
status is 0 only when both instances are ok (no corrupted, unverified or failed block; a put the
full store refused is not a failure: that block is just not shared) and B found hits in the store.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Final, TextIO

import attrs

from kvoffload import KVOffloadError
from kvoffload.cli._replay_model import EXIT_FAILED, EXIT_OK, ReplayConfig, ReplayReport
from kvoffload.testing import MooncakeServices, RedisClusterServices, enter_loopback_namespace

__all__ = ["two_instances"]

#: Instance B's deadline: at least this, or a few times instance A's run.
PEER_TIMEOUT_MIN_S: Final = 600.0


def _start(remote: str, nbytes: int) -> tuple[MooncakeServices | RedisClusterServices, str]:
    """Start the store's services on this machine, lending ``nbytes`` to the store (each Redis node
    gets a third: the cluster holds about ``nbytes``); returns them and their address. A full store
    evicts: Mooncake what was not accessed for a second, Redis by approximate LRU."""
    if remote == "mooncake":
        enter_loopback_namespace()
        mooncake = MooncakeServices.start(segment_bytes=nbytes)
        return mooncake, mooncake.master_address
    redis = RedisClusterServices.start(maxmemory_bytes=nbytes // 3, policy="allkeys-lru")
    return redis, ",".join(f"{host}:{port}" for host, port in redis.nodes)


def two_instances(
    args: argparse.Namespace,
    argv: Sequence[str],
    config: ReplayConfig,
    run: Callable[[ReplayConfig, TextIO | None], ReplayReport],
    show: Callable[[ReplayReport], None],
) -> int:
    """Run instance A here and instance B in another process (module docstring); print both.

    ``run(config, progress)`` runs one instance and ``show(report)`` prints its report (the replay's
    own). Returns the exit status.
    """
    services: MooncakeServices | RedisClusterServices | None = None
    try:
        address = config.remote_address
        if not address:
            services, address = _start(str(config.remote), args.remote_mib << 20)
        config = attrs.evolve(config, remote_address=address)
        config.check()
        print(f"instance A (this process, pid {os.getpid()}): stores, writes through to {config.remote} "
              f"at {address}", flush=True)
        first = run(config, None if args.quiet else sys.stderr)
        show(first)
        peer, peer_out = _peer(argv, address, first.wall_s)
        print(f"instance B (another process): the same workload against the same store\n{peer_out}",
              end="", flush=True)
    except KVOffloadError as exc:
        print(f"kvoffload replay --remote: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if services is not None:
            services.stop()
    remote_hits = int(peer.get("hits_by_tier", {}).get("remote", 0))
    looked = max(1, int(peer.get("lookup_blocks", 0)))
    ok = first.ok and bool(peer.get("ok")) and remote_hits > 0
    print(f"two instances: B read {remote_hits} of its {looked} looked-up blocks from the store that A "
          f"filled ({100 * remote_hits / looked:.1f} %), every one verified; corrupted blocks: A "
          f"{first.corrupted_blocks}, B {peer.get('corrupted_blocks')}; result "
          f"{'OK' if ok else 'FAILED'}"
          + ("" if remote_hits else " (B found nothing in the store: evicted? a larger --remote-mib keeps more)"),
          flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": attrs.asdict(config), "report": first.to_json(), "instance_b": peer}, f,
                      indent=2, sort_keys=True)
            f.write("\n")
    return EXIT_OK if ok else EXIT_FAILED


def _peer(argv: Sequence[str], address: str, first_wall_s: float) -> tuple[dict[str, Any], str]:
    """Run instance B with the same options against ``address``; its JSON report and its output."""
    timeout = max(PEER_TIMEOUT_MIN_S, 4 * first_wall_s)
    with tempfile.TemporaryDirectory(prefix="kvoffload-replay-") as tmp:
        report_path = os.path.join(tmp, "instance-b.json")
        command = [sys.executable, "-m", "kvoffload", "replay", *argv, "--remote-address", address,
                   "--instance-only", "--quiet", "--json", report_path]
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=30)
            raise KVOffloadError(f"instance B (pid {proc.pid}) did not finish within {timeout:g} s") from None
        if not os.path.exists(report_path):
            raise KVOffloadError(f"instance B exited with status {proc.returncode} without a report:\n{out}")
        with open(report_path, encoding="utf-8") as f:
            report: dict[str, Any] = json.load(f)["report"]
    return report, out
