"""``python -m kvoffload bench --remote mooncake|redis``: the remote tier against the store's own client.

It starts the store's services on this machine (Mooncake inside a loopback-only network namespace,
which this process enters: root or CAP_SYS_ADMIN; a 3-node Redis Cluster on 127.0.0.1), or uses
running ones (``--master HOST:PORT`` / ``--nodes HOST:PORT,...``). A host Worker with a remote tier
holds the records in its host pool; each round moves the same records both ways through kvoffload
(``Worker.put_remote``/``get_remote``: CRC32s, header pages, every record verified; timed from the
call to the result) and through the store's plain client (Mooncake: the same zero-copy two-buffer
batch calls on the same registered memory; Redis: pipelined ``SET`` of ready-made values and ``GET``
copied into host rows), the two in alternating order, and removes the keys before the next round
(through the store's own client, by the names the store documents).
Every record kvoffload reads back is compared byte for byte with its source; a difference fails the
run (exit status 1). Figures are medians over the rounds, as GB/s of record bytes (header page +
host record) and the ratio kvoffload / own client.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from kvoffload import (
    DeviceLayout,
    KVOffloadError,
    MooncakeConfig,
    RedisClusterConfig,
    RemoteConfig,
    Worker,
)
from kvoffload.cli._args import check_memory, finite_float, host_port, host_ports, int_in, writable_file
from kvoffload.testing import MooncakeServices, RedisClusterServices, enter_loopback_namespace

__all__ = ["main"]

U8Array = npt.NDArray[np.uint8]
HEADER_BYTES: Final = 4096
#: The remote tier's limits (``MooncakeConfig``/``RedisClusterConfig``).
MAX_BATCH_RECORDS: Final = 4096
MAX_CHECKSUM_THREADS: Final = 64
CALL_TIMEOUT_S: Final = 300.0
SETUP_TIMEOUT_S: Final = 60.0


def _record_mib(text: str) -> float:
    value = finite_float(0, low_open=True)(text)
    if int(value * (1 << 20)) < HEADER_BYTES:
        raise argparse.ArgumentTypeError(f"{text} must be at least {HEADER_BYTES / (1 << 20):g} (one page)")
    return value


def _address(text: str) -> str:
    host_port(text)
    return text


def _addresses(text: str) -> str:
    host_ports(text)
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvoffload bench --remote", description=__doc__.splitlines()[0])
    p.add_argument("--remote", choices=("mooncake", "redis"), required=True)
    p.add_argument("--records", type=int_in(1), default=256, help="records per round (default 256)")
    p.add_argument("--record-mib", type=_record_mib, default=2.0, help="host record size in MiB (default 2)")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH_RECORDS), default=32,
                   help="records per client call (default 32)")
    p.add_argument("--rounds", type=int_in(1), default=3, help="rounds; figures are medians (default 3)")
    p.add_argument("--checksum-threads", type=int_in(1, MAX_CHECKSUM_THREADS), default=2)
    p.add_argument("--master", type=_address, default=None,
                   help="use this running Mooncake master (HOST:PORT) instead of starting one")
    p.add_argument("--nodes", type=_addresses, default=None,
                   help="use this running Redis cluster (HOST:PORT,...) instead of starting one")
    p.add_argument("--json", type=writable_file, default=None, metavar="PATH",
                   help="also write the figures as JSON")
    return p


def _in_thread(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` on a helper thread with a deadline (a client's set-up may hang on a dead master)."""
    box: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=target, name="kvoffload-bench-setup", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise KVOffloadError(f"{what} did not finish within {timeout:g} s")
    if errors:
        raise errors[0]
    return box[0]


class _RawMooncake:
    """The plain Mooncake client moving the same rows with the same batched two-buffer calls."""

    def __init__(self, master: str, rows: U8Array, out: U8Array, batch: int) -> None:
        module: Any = importlib.import_module("mooncake.store")
        self._store: Any = _in_thread(lambda: self._setup(module, master), SETUP_TIMEOUT_S, "joining Mooncake")
        self._rows, self._out, self._batch = rows, out, batch
        self._headers = np.zeros((rows.shape[0], HEADER_BYTES), dtype=np.uint8)
        self._registered: list[int] = []
        for array in (rows, out, self._headers):
            if self._store.register_buffer(int(array.ctypes.data), array.nbytes) != 0:
                self.close()
                raise KVOffloadError("the raw Mooncake client could not register the rows")
            self._registered.append(int(array.ctypes.data))
        self._sizes = [HEADER_BYTES, int(rows.shape[1])]

    @staticmethod
    def _setup(module: Any, master: str) -> Any:
        store = module.MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
            raise KVOffloadError(f"the raw Mooncake client could not join {master}")
        return store

    def _ptrs(self, rows: U8Array, start: int, stop: int) -> list[list[int]]:
        r, h = int(rows.ctypes.data), int(self._headers.ctypes.data)
        size = int(rows.shape[1])
        return [[h + i * HEADER_BYTES, r + i * size] for i in range(start, stop)]

    def put(self, names: list[str]) -> None:
        for s in range(0, len(names), self._batch):
            e = min(s + self._batch, len(names))
            codes = self._store.batch_put_from_multi_buffers(names[s:e], self._ptrs(self._rows, s, e),
                                                              [self._sizes] * (e - s))
            if any(c != 0 for c in codes):
                raise KVOffloadError(f"raw Mooncake put failed: {set(codes)}")

    def get(self, names: list[str]) -> None:
        for s in range(0, len(names), self._batch):
            e = min(s + self._batch, len(names))
            codes = self._store.batch_get_into_multi_buffers(names[s:e], self._ptrs(self._out, s, e),
                                                              [self._sizes] * (e - s))
            if any(c < 0 for c in codes):
                raise KVOffloadError(f"raw Mooncake get failed: {set(codes)}")

    def remove(self, names: list[str]) -> None:
        self._store.batch_remove(names, force=True)

    def close(self) -> None:
        for base in self._registered:
            self._store.unregister_buffer(base)
        self._store.close()


class _RawRedis:
    """The plain Redis Cluster client: pipelined SET of ready values, GET copied into the rows."""

    def __init__(self, nodes: Sequence[tuple[str, int]], rows: U8Array, out: U8Array, batch: int) -> None:
        module: Any = importlib.import_module("redis.cluster")
        self._cluster: Any = module.RedisCluster(
            startup_nodes=[module.ClusterNode(h, p) for h, p in nodes], socket_timeout=60
        )
        self._out, self._batch = out, batch
        values = np.zeros((rows.shape[0], HEADER_BYTES + rows.shape[1]), dtype=np.uint8)
        values[:, HEADER_BYTES:] = rows
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
                self._out[i] = np.frombuffer(value, dtype=np.uint8)[HEADER_BYTES:]

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
    """Run the remote bench; returns 0, 1 when a record read back differs, 2 on a usage or set-up error."""
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.master is not None and args.remote != "mooncake":
        parser.error(f"argument --master: {args.master!r} names a Mooncake master; --remote {args.remote} "
                     "takes --nodes")
    if args.nodes is not None and args.remote != "redis":
        parser.error(f"argument --nodes: {args.nodes!r} names Redis nodes; --remote {args.remote} takes --master")
    record_bytes = int(args.record_mib * (1 << 20)) // HEADER_BYTES * HEADER_BYTES
    n, batch = args.records, args.batch
    # the host pool (2n records), the raw client's copy, and a store started here of about 3x the records
    check_memory(parser, 3 * n * record_bytes + 3 * (HEADER_BYTES + record_bytes) * n,
                 f"--records {n} of --record-mib {args.record_mib:g}", "--records or --record-mib")
    services: MooncakeServices | RedisClusterServices | None = None
    worker: Worker | None = None
    raw: _RawMooncake | _RawRedis | None = None
    record_total = (HEADER_BYTES + record_bytes) * n
    # the engine's cache is one CPU tensor whose blocks are records of exactly record_bytes
    layout = DeviceLayout.from_tensors({"kv": torch.zeros((2, record_bytes), dtype=torch.uint8)}, 0,
                                       model_id="kvoffload-remote-bench")
    try:
        if args.remote == "mooncake":
            master = args.master
            if master is None:
                enter_loopback_namespace()
                services = MooncakeServices.start(segment_bytes=3 * record_total, lease_ttl_ms=10_000)
                master = services.master_address
                where = "a master and one lender on 127.0.0.1, in a loopback-only network namespace"
            else:
                where = f"master {master}"
            store: MooncakeConfig | RedisClusterConfig = MooncakeConfig(
                master_address=master, batch_records=batch, checksum_threads=args.checksum_threads)
        else:
            if args.nodes is None:
                services = RedisClusterServices.start(maxmemory_bytes=2 * record_total, policy="noeviction")
                nodes: tuple[tuple[str, int], ...] = services.nodes
                where = "3 Redis nodes in cluster mode on 127.0.0.1"
            else:
                nodes = host_ports(args.nodes)
                where = f"cluster {args.nodes}"
            store = RedisClusterConfig(nodes=nodes, batch_records=batch, checksum_threads=args.checksum_threads)
        worker = Worker.create(layout, 2 * n, backend="host",
                               remote=RemoteConfig(store=store, job_timeout_s=CALL_TIMEOUT_S))
        rows: U8Array = worker.host_records().numpy()
        rows[:n] = np.random.default_rng(0).integers(0, 256, size=(n, record_bytes), dtype=np.uint8)
        raw_out = np.zeros((n, record_bytes), dtype=np.uint8)
        if isinstance(store, MooncakeConfig):
            raw = _RawMooncake(store.master_address, rows[:n], raw_out, batch)
        else:
            raw = _RawRedis(store.nodes, rows[:n], raw_out, batch)
        return _run(args, store, worker, raw, rows, raw_out, record_bytes, record_total, where)
    except KVOffloadError as exc:
        print(f"remote bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        if raw is not None:
            raw.close()
        if worker is not None:
            worker.shutdown()
        if services is not None:
            services.stop()


def _run(
    args: argparse.Namespace,
    store: MooncakeConfig | RedisClusterConfig,
    worker: Worker,
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
    job = 0

    def through_worker(submit: Callable[[int], None]) -> None:
        nonlocal job
        job += 1
        submit(job)
        (result,) = worker.wait([job], CALL_TIMEOUT_S)
        if not result.ok:
            raise KVOffloadError(f"kvoffload {result.direction.value} failed: {result.error}")

    for r in range(args.rounds):
        keys = [f"bench/r{r}/{i}".encode() for i in range(n)]
        names: list[Any] = [f"raw/r{r}/{i}" for i in range(n)] if args.remote == "mooncake" else [b"raw/" + k for k in keys]
        rows[n:] = 0

        def kvo_put() -> None:
            through_worker(lambda j: worker.put_remote(j, list(range(n)), keys))

        def kvo_get() -> None:
            through_worker(lambda j: worker.get_remote(j, keys, list(range(n, 2 * n))))

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
        raw.remove(names)
        raw.remove(stored_names(store, keys))
    gbps = {k: record_total / statistics.median(v) / 1e9 for k, v in times.items()}
    stats = worker.remote_stats()
    report = {
        "remote": args.remote, "where": where, "records": n, "record_bytes": record_bytes,
        "header_bytes": HEADER_BYTES, "batch": args.batch, "rounds": args.rounds,
        "checksum_threads": args.checksum_threads,
        "put_gbps": {"kvoffload": gbps["kvo_put"], "own_client": gbps["raw_put"],
                     "ratio": gbps["kvo_put"] / gbps["raw_put"]},
        "get_gbps": {"kvoffload": gbps["kvo_get"], "own_client": gbps["raw_get"],
                     "ratio": gbps["kvo_get"] / gbps["raw_get"]},
        "records_verified": verified, "records_read": n * args.rounds,
        "failed_keys": sum(stats.failures.values()) if stats is not None else 0,
    }
    print(f"remote bench: {args.remote}, {n} records of {record_bytes / (1 << 20):g} MiB (+4 KiB header), "
          f"batch {args.batch}, {args.rounds} rounds (medians), {where}")
    print(f"{'':8}{'kvoffload GB/s':>16}{'own client GB/s':>18}{'ratio':>9}")
    for op in ("put", "get"):
        g = report[f"{op}_gbps"]
        assert isinstance(g, dict)
        print(f"{op:8}{g['kvoffload']:>16.2f}{g['own_client']:>18.2f}{g['ratio']:>8.2f}x")
    print(f"records read back through kvoffload: {verified}/{n * args.rounds} bit-exact (CRC-verified)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0 if verified == n * args.rounds else 1


def stored_names(store: MooncakeConfig | RedisClusterConfig, keys: list[bytes]) -> list[Any]:
    """The names the store holds kvoffload's keys under (each store's documented naming), so that
    the store's own client removes a round's records."""
    if isinstance(store, MooncakeConfig):
        return [store.key_prefix + key.hex() for key in keys]
    return [store.key_prefix + key for key in keys]
