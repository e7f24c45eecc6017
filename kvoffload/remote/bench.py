"""Remote bench: put and get GB/s through kvoffload vs the store's own client, in the same run.

``main(["--remote", "mooncake"])`` (or ``"redis"``) starts the store's services on this machine
(Mooncake inside a loopback-only network namespace, which this process enters: root or
CAP_SYS_ADMIN), or uses running ones (``--master HOST:PORT`` / ``--nodes HOST:PORT,...``). Each round
moves the same records both ways through a kvoffload store (CRC32s, header pages, verification) and
through the store's plain client (Mooncake: the same zero-copy two-buffer batch calls on registered
memory; Redis: pipelined ``SET`` of ready-made values and ``GET`` copied into the host rows), the two
in alternating order, and removes the keys before the next round. Every record kvoffload reads back is
compared byte for byte with its source; a difference fails the run (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvoffload.errors import KVOffloadError
from kvoffload.remote._base import RemoteStoreBase
from kvoffload._record import PAGE_BYTES
from kvoffload.remote.mooncake import MooncakeConfig, MooncakeStore
from kvoffload.remote.redis_cluster import RedisClusterConfig, RedisClusterStore
from kvoffload.remote.services import (
    MooncakeServices,
    RedisClusterServices,
    enter_loopback_namespace,
    loopback_only,
)

__all__ = ["main"]

U8Array = npt.NDArray[np.uint8]
CALL_TIMEOUT_S: Final = 300.0
FINGERPRINT: Final = "kvoffload-remote-bench"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvoffload bench --remote", description=__doc__.splitlines()[0])
    p.add_argument("--remote", choices=("mooncake", "redis"), required=True)
    p.add_argument("--records", type=int, default=256, help="records per round (default 256)")
    p.add_argument("--record-mib", type=float, default=2.0, help="host record size in MiB (default 2)")
    p.add_argument("--batch", type=int, default=32, help="records per client call (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    p.add_argument("--checksum-threads", type=int, default=2)
    p.add_argument("--master", help="use this running Mooncake master (HOST:PORT) instead of starting one")
    p.add_argument("--nodes", help="use this running Redis cluster (HOST:PORT,...) instead of starting one")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


class _RawMooncake:
    """The plain Mooncake client moving the same rows with the same batched two-buffer calls."""

    def __init__(self, master: str, rows: U8Array, out: U8Array, batch: int) -> None:
        from kvoffload.remote._lane import Lane  # noqa: PLC0415 - set-up helper only

        import importlib  # noqa: PLC0415

        module: Any = importlib.import_module("mooncake.store")
        self._store: Any = Lane("bench-raw").call(lambda: self._setup(module, master), 60.0)
        self._rows, self._out, self._batch = rows, out, batch
        self._headers = np.zeros((rows.shape[0], PAGE_BYTES), dtype=np.uint8)
        for array in (rows, out, self._headers):
            if self._store.register_buffer(int(array.ctypes.data), array.nbytes) != 0:
                raise KVOffloadError("the raw Mooncake client could not register the rows")
        self._sizes = [PAGE_BYTES, int(rows.shape[1])]

    @staticmethod
    def _setup(module: Any, master: str) -> Any:
        store = module.MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
            raise KVOffloadError(f"the raw Mooncake client could not join {master}")
        return store

    def _ptrs(self, rows: U8Array, start: int, stop: int) -> list[list[int]]:
        r, h = int(rows.ctypes.data), int(self._headers.ctypes.data)
        size = int(rows.shape[1])
        return [[h + i * PAGE_BYTES, r + i * size] for i in range(start, stop)]

    def put(self, names: list[str]) -> None:
        for s in range(0, len(names), self._batch):
            e = min(s + self._batch, len(names))
            codes = self._store.batch_put_from_multi_buffers(names[s:e], self._ptrs(self._rows, s, e), [self._sizes] * (e - s))
            if any(c != 0 for c in codes):
                raise KVOffloadError(f"raw Mooncake put failed: {set(codes)}")

    def get(self, names: list[str]) -> None:
        for s in range(0, len(names), self._batch):
            e = min(s + self._batch, len(names))
            codes = self._store.batch_get_into_multi_buffers(names[s:e], self._ptrs(self._out, s, e), [self._sizes] * (e - s))
            if any(c < 0 for c in codes):
                raise KVOffloadError(f"raw Mooncake get failed: {set(codes)}")

    def remove(self, names: list[str]) -> None:
        self._store.batch_remove(names, force=True)

    def close(self) -> None:
        for array in (self._rows, self._out, self._headers):
            self._store.unregister_buffer(int(array.ctypes.data))
        self._store.close()


class _RawRedis:
    """The plain Redis Cluster client: pipelined SET of ready values, GET copied into the rows."""

    def __init__(self, nodes: Sequence[tuple[str, int]], rows: U8Array, out: U8Array, batch: int) -> None:
        import importlib  # noqa: PLC0415

        module: Any = importlib.import_module("redis.cluster")
        self._cluster: Any = module.RedisCluster(
            startup_nodes=[module.ClusterNode(h, p) for h, p in nodes], socket_timeout=60
        )
        self._out, self._batch = out, batch
        values = np.zeros((rows.shape[0], PAGE_BYTES + rows.shape[1]), dtype=np.uint8)
        values[:, PAGE_BYTES:] = rows
        self._values = values

    def put(self, names: list[bytes]) -> None:
        for s in range(0, len(names), self._batch):
            pipe = self._cluster.pipeline(transaction=False)
            for i in range(s, min(s + self._batch, len(names))):
                pipe.set(names[i], memoryview(self._values[i]))
            pipe.execute()

    def get(self, names: list[bytes]) -> None:
        for s in range(0, len(names), self._batch):
            pipe = self._cluster.pipeline(transaction=False)
            stop = min(s + self._batch, len(names))
            for i in range(s, stop):
                pipe.get(names[i])
            for i, value in zip(range(s, stop), pipe.execute()):
                self._out[i] = np.frombuffer(value, dtype=np.uint8)[PAGE_BYTES:]

    def remove(self, names: list[bytes]) -> None:
        for s in range(0, len(names), self._batch):
            pipe = self._cluster.pipeline(transaction=False)
            for name in names[s : s + self._batch]:
                pipe.delete(name)
            pipe.execute()

    def close(self) -> None:
        self._cluster.close()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    """Run the remote bench; returns 0, 1 when a record read back differs, 2 on a usage error."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    record_bytes = int(args.record_mib * (1 << 20)) // PAGE_BYTES * PAGE_BYTES
    n, batch = args.records, args.batch
    if record_bytes <= 0 or n <= 0 or batch <= 0 or args.rounds <= 0:
        print("records, record size, batch and rounds must be positive", file=sys.stderr)
        return 2
    record_total = (PAGE_BYTES + record_bytes) * n
    rows = np.random.default_rng(0).integers(0, 256, size=(2 * n, record_bytes), dtype=np.uint8)
    raw_out = np.zeros((n, record_bytes), dtype=np.uint8)
    services: MooncakeServices | RedisClusterServices | None = None
    store: RemoteStoreBase | None = None
    raw: _RawMooncake | _RawRedis | None = None
    where = "given services"
    try:
        if args.remote == "mooncake":
            master = args.master
            if master is None:
                enter_loopback_namespace()
                services = MooncakeServices.start(segment_bytes=3 * record_total, lease_ttl_ms=10_000)
                master = services.master_address
                where = "a master and one lender on 127.0.0.1, in a loopback-only network namespace"
            elif not loopback_only():
                where = f"master {master}"
            store = MooncakeStore.create(
                MooncakeConfig(master_address=master, batch_records=batch, checksum_threads=args.checksum_threads),
                host_rows=rows, fingerprint=FINGERPRINT,
            )
            raw = _RawMooncake(master, rows[:n], raw_out, batch)
        else:
            if args.nodes is None:
                services = RedisClusterServices.start(maxmemory_bytes=2 * record_total, policy="noeviction")
                nodes: tuple[tuple[str, int], ...] = services.nodes
                where = "3 Redis nodes in cluster mode on 127.0.0.1"
            else:
                nodes = tuple((h, int(p)) for h, p in (x.rsplit(":", 1) for x in args.nodes.split(",")))
                where = f"cluster {args.nodes}"
            store = RedisClusterStore.create(
                RedisClusterConfig(nodes=nodes, batch_records=batch, checksum_threads=args.checksum_threads),
                host_rows=rows, fingerprint=FINGERPRINT,
            )
            raw = _RawRedis(nodes, rows[:n], raw_out, batch)
        return _run(args, store, raw, rows, raw_out, record_bytes, record_total, where)
    except KVOffloadError as exc:
        print(f"remote bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        if raw is not None:
            raw.close()
        if store is not None:
            store.close()
        if services is not None:
            services.stop()


def _run(
    args: argparse.Namespace,
    store: RemoteStoreBase,
    raw: _RawMooncake | _RawRedis,
    rows: U8Array,
    raw_out: U8Array,
    record_bytes: int,
    record_total: int,
    where: str,
) -> int:
    n = args.records
    times: dict[str, list[float]] = {"kvo_put": [], "raw_put": [], "kvo_get": [], "raw_get": []}
    verified = 0
    for r in range(args.rounds):
        keys = [f"r{r}/{i}".encode() for i in range(n)]
        names: list[Any] = [f"raw/r{r}/{i}" for i in range(n)] if args.remote == "mooncake" else [b"raw/" + k for k in keys]
        rows[n:] = 0

        def kvo_put() -> None:
            result = store.put(keys, range(n), timeout=CALL_TIMEOUT_S)
            if not result.ok:
                raise KVOffloadError(f"kvoffload put failed: {result.error}")

        def kvo_get() -> None:
            result = store.get(keys, range(n, 2 * n), timeout=CALL_TIMEOUT_S)
            if not result.ok:
                raise KVOffloadError(f"kvoffload get failed: {result.error}")

        order = [("kvo", kvo_put, kvo_get), ("raw", lambda: raw.put(names), lambda: raw.get(names))]
        if r % 2:
            order.reverse()
        for tag, put, _ in order:
            times[f"{tag}_put"].append(_timed(put))
        for tag, _, get in order:
            times[f"{tag}_get"].append(_timed(get))
        verified += int(sum(np.array_equal(rows[n + i], rows[i]) for i in range(n)))
        if not np.array_equal(raw_out, rows[:n]):
            raise KVOffloadError("the raw client's get returned other bytes than were put")
        store.remove(keys, timeout=CALL_TIMEOUT_S)
        raw.remove(names)
    gbps = {k: record_total / statistics.median(v) / 1e9 for k, v in times.items()}
    report = {
        "remote": args.remote, "where": where, "records": n, "record_bytes": record_bytes,
        "header_bytes": PAGE_BYTES, "batch": args.batch, "rounds": args.rounds,
        "checksum_threads": args.checksum_threads,
        "put_gbps": {"kvoffload": gbps["kvo_put"], "own_client": gbps["raw_put"],
                     "ratio": gbps["kvo_put"] / gbps["raw_put"]},
        "get_gbps": {"kvoffload": gbps["kvo_get"], "own_client": gbps["raw_get"],
                     "ratio": gbps["kvo_get"] / gbps["raw_get"]},
        "records_verified": verified, "records_read": n * args.rounds,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"remote bench: {args.remote}, {n} records of {record_bytes / (1 << 20):g} MiB (+4 KiB header), "
              f"batch {args.batch}, {args.rounds} rounds (medians), {where}")
        print(f"{'':8}{'kvoffload GB/s':>16}{'own client GB/s':>18}{'ratio':>9}")
        for op in ("put", "get"):
            g = report[f"{op}_gbps"]
            assert isinstance(g, dict)
            print(f"{op:8}{g['kvoffload']:>16.2f}{g['own_client']:>18.2f}{g['ratio']:>8.2f}x")
        print(f"records read back through kvoffload: {verified}/{n * args.rounds} bit-exact (CRC-verified)")
    return 0 if verified == n * args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
