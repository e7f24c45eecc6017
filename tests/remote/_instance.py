"""One engine instance of the two-instance test, run as ``python -m tests.remote._instance``.

``writer``: computes ``--blocks`` blocks (a key-derived pattern in its device cache), stores them
through the Manager's protocol and writes them through to the store. ``reader``: a fresh instance
(empty host pool) that looks the same keys up, reads the remote hits into its host pool, loads them
into its device cache and compares every byte with the pattern it computes itself. Each prints one
JSON line of counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence

import torch

from kvoffload import (
    DeviceLayout,
    Manager,
    MooncakeConfig,
    RedisClusterConfig,
    RemoteConfig,
    Tier,
    Worker,
    open_remote_index,
)

RECORD = 64 << 10
WAIT_S = 60.0


def pattern(layout: DeviceLayout, keys: Sequence[bytes]) -> torch.Tensor:
    """``uint8 [len(keys), record_bytes]``: each key's bytes, from a seed derived from the key."""
    out = torch.empty((len(keys), layout.record_bytes), dtype=torch.uint8)
    for i, key in enumerate(keys):
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & 0x7FFFFFFF
        out[i] = torch.randint(0, 256, (layout.record_bytes,), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(seed))
    return out


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("writer", "reader"))
    p.add_argument("--backend", choices=("mooncake", "redis"), required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--blocks", type=int, default=24)
    args = p.parse_args(argv)
    n = args.blocks
    if args.backend == "mooncake":
        store: MooncakeConfig | RedisClusterConfig = MooncakeConfig(master_address=args.address, key_prefix=args.prefix)
    else:
        nodes = tuple((h, int(port)) for h, port in (x.rsplit(":", 1) for x in args.address.split(",")))
        store = RedisClusterConfig(nodes=nodes, key_prefix=args.prefix.encode())
    config = RemoteConfig(store=store)
    cache = torch.zeros((2 * n, RECORD), dtype=torch.uint8)
    layout = DeviceLayout.from_tensors({"kv": cache}, 0, model_id="two-instances")
    keys = [f"prefix-block-{i}".encode() for i in range(n)]
    index = open_remote_index(config, fingerprint=layout.fingerprint)
    manager = Manager.create(n, fingerprint=layout.fingerprint, remote=index)
    out: dict[str, int] = {}
    try:
        with Worker.create(layout, n, remote=config) as worker:
            if args.role == "writer":
                layout.scatter_records(torch.arange(n), pattern(layout, keys))  # the "compute"
                plan = manager.prepare_store(keys)
                assert plan is not None
                worker.store(1, list(range(n)), list(plan.host_blocks))
                (stored,) = worker.wait([1], WAIT_S)
                manager.complete_store(plan, stored.ok)
                put = manager.prepare_remote_put(keys)
                worker.put_remote(2, list(put.host_blocks), list(put.remote_keys))
                (done,) = worker.wait([2], WAIT_S)
                manager.complete_remote_put(put, done.ok)
                out = {"stored": len(plan.keys) if stored.ok else 0, "put": len(put.keys) if done.ok else 0}
            else:
                hits = manager.lookup(keys)
                load = manager.prepare_load(keys[:hits])
                remote = [i for i, tier in enumerate(load.tiers) if tier is Tier.REMOTE]
                host = [load.blocks[i] for i in remote]
                worker.get_remote(1, [manager.namespaced(load.keys[i]) for i in remote], host)
                (got,) = worker.wait([1], WAIT_S)
                targets = [n + i for i in remote]
                ok = got.ok
                if ok:
                    worker.load(2, host, targets)
                    ok = worker.wait([2], WAIT_S)[0].ok
                manager.complete_load(load, ok=ok)
                loaded = layout.gather_records(targets)
                expected = pattern(layout, [load.keys[i] for i in remote])
                corrupted = int((loaded != expected).any(dim=1).sum()) if ok else 0
                out = {"looked_up": len(keys), "hits": hits, "remote_hits": len(remote),
                       "verified": len(remote) if ok else 0, "corrupted": corrupted, "ok": int(ok),
                       "remote_lookup_hits": manager.stats().remote_lookup_hits}
    finally:
        index.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
