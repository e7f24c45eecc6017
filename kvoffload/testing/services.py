"""Real store services on this machine, for tests and the bench: a Mooncake cluster and a Redis Cluster.

Both start real processes with bounded waits, write only inside one temporary directory (removed at
``stop``), and are stopped by their own process ids: ``stop`` sends SIGTERM, waits, then SIGKILL.

* :class:`MooncakeServices`: a master (``mooncake_master``) and one process lending memory to the
  cluster (``mooncake_client`` with ``global_segment_size``), metadata by P2P handshake, TCP. Mooncake's
  transfer listeners bind every interface whatever address they are given, so it starts only inside a
  loopback-only network namespace: call :func:`enter_loopback_namespace` first (root, or
  CAP_SYS_ADMIN); the client in the calling process then lives in that namespace too.
* :class:`RedisClusterServices`: three ``redis-server`` in cluster mode on 127.0.0.1, joined with
  ``redis-cli --cluster create ... --cluster-replicas 0``, with ``maxmemory`` and a policy.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import importlib.util
import os
import pathlib
import random
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import IO, Any, Final

from typing_extensions import Self

from kvoffload.errors import KVOffloadError
from kvoffload.remote.mooncake import MooncakeConfig
from kvoffload.remote.redis_cluster import RedisClusterConfig

__all__ = [
    "MooncakeServices",
    "RedisClusterServices",
    "ServiceError",
    "enter_loopback_namespace",
    "loopback_only",
]

LOOPBACK: Final = "127.0.0.1"
_CLONE_NEWNET: Final = 0x40000000
_SIOCGIFFLAGS: Final = 0x8913
_SIOCSIFFLAGS: Final = 0x8914
_IFF_UP: Final = 0x1
_IFREQ: Final = struct.Struct("16sH22x")
_POLL_S: Final = 0.05
_STOP_GRACE_S: Final = 5.0
#: Redis Cluster nodes talk on their port + this (the cluster bus).
REDIS_BUS_OFFSET: Final = 10000


class ServiceError(KVOffloadError):
    """A test service could not be started (a missing program, a port that did not open in time,
    no permission to create a network namespace); the message says which and why. Whatever was
    started before the failure has been stopped and its files removed."""


# --------------------------------------------------------------------------- network namespace


def loopback_only() -> bool:
    """True when this thread's network namespace has no interface but ``lo``, and ``lo`` is up."""
    return _interfaces() == {"lo"} and _lo_flags() & _IFF_UP != 0


def _interfaces() -> set[str]:
    """Interface names of this thread's network namespace (sysfs may show another one's)."""
    return {name for _, name in socket.if_nameindex()}


def _lo_flags() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        reply = fcntl.ioctl(sock, _SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0))
    return int(_IFREQ.unpack(reply)[1])


def enter_loopback_namespace() -> None:
    """Move the calling thread into a new network namespace that has only ``lo``, and bring it up.

    Threads and processes started by the calling thread afterwards live there too; threads that
    already exist stay where they are (call it early, from the main thread). A no-op when the thread
    is already in a loopback-only namespace.

    Raises:
        ServiceError: the kernel refused (no permission, no namespaces); nothing changed.
    """
    if _interfaces() == {"lo"}:
        _bring_lo_up()
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise ServiceError(f"cannot create a network namespace: unshare(CLONE_NEWNET): {os.strerror(err)}")
    _bring_lo_up()


def _bring_lo_up() -> None:
    flags = _lo_flags()
    if not flags & _IFF_UP:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            fcntl.ioctl(sock, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))


# ------------------------------------------------------------------------------- processes


def _free_port(*, bus: bool = False) -> int:
    """A port on 127.0.0.1 nobody listens on (and, with ``bus``, port + 10000 too)."""
    for _ in range(200):
        port = random.randint(20000, 29999)
        ports = (port, port + REDIS_BUS_OFFSET) if bus else (port,)
        try:
            for p in ports:
                with socket.socket() as sock:
                    sock.bind((LOOPBACK, p))
        except OSError:
            continue
        return port
    raise ServiceError("no free port on 127.0.0.1 in 200 tries")


def _wait_port(port: int, deadline: float, proc: subprocess.Popen[bytes], what: str, log: pathlib.Path) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"{what} exited with status {proc.returncode}: {_tail(log)}")
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(_POLL_S)
    raise ServiceError(f"{what} did not listen on {LOOPBACK}:{port} in time: {_tail(log)}")


def _tail(log: pathlib.Path, lines: int = 5) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Processes:
    """Processes started by one service set, their log files and the temporary directory."""

    def __init__(self, prefix: str) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self.stopped = False

    def spawn(self, argv: Sequence[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.dir / log_name, "wb")  # noqa: SIM115 - closed in stop
        self._logs.append(log)
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=self.dir, env=env, start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def stop(self, timeout: float = _STOP_GRACE_S) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.signal_all(signal.SIGCONT)
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        for log in self._logs:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _mooncake_program(name: str) -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ServiceError("the 'mooncake' package is not installed (pip install 'kvoffload[mooncake]')")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / name
    if not path.is_file():
        raise ServiceError(f"{path} is missing from the mooncake package")
    return str(path)


class _ServiceGroup:
    """What every group of service processes started here can do, by their own pids: kill, pause,
    resume and stop (stop also removes the group's temporary directory; idempotent)."""

    _procs: _Processes

    def kill(self) -> None:
        """SIGKILL every process of the group (files stay until ``stop``)."""
        self._procs.signal_all(signal.SIGKILL)
        for proc in self._procs.procs:
            proc.wait(_STOP_GRACE_S)

    def pause(self) -> None:
        """SIGSTOP every process (connections stay open, nothing answers)."""
        self._procs.signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT every process."""
        self._procs.signal_all(signal.SIGCONT)

    def stop(self) -> None:
        """Stop every process by its pid and remove the temporary directory (idempotent)."""
        self._procs.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MooncakeServices(_ServiceGroup):
    """A Mooncake master and one process lending ``segment_bytes`` of memory, on 127.0.0.1.

    Owns both processes and the temporary directory with their logs. Create with :meth:`start`;
    release with :meth:`stop` (idempotent; also a context manager).
    """

    def __init__(self, procs: _Processes, master_port: int, master: subprocess.Popen[bytes],
                 lender: subprocess.Popen[bytes]) -> None:
        self._procs = procs
        self.master_port = master_port
        self.master = master
        self.lender = lender

    @classmethod
    def start(cls, *, segment_bytes: int = 256 << 20, lease_ttl_ms: int = 1000, timeout: float = 30.0) -> MooncakeServices:
        """Start the master, then the lender, each waited for until it listens (within ``timeout``).

        ``lease_ttl_ms`` is the master's lease of an object after each access (it is not evicted or
        removed while leased).

        Raises:
            ServiceError: not in a loopback-only namespace, the package missing, a process that
                exited or did not listen in time (everything started is stopped).
        """
        if not loopback_only():
            raise ServiceError(
                "Mooncake's listeners bind every interface: start it only inside a loopback-only "
                "network namespace (enter_loopback_namespace())"
            )
        master_bin, lender_bin = _mooncake_program("mooncake_master"), _mooncake_program("mooncake_client")
        procs = _Processes("kvoffload-mooncake-")
        env = dict(os.environ, GLOG_logtostderr="1")
        deadline = time.monotonic() + timeout
        try:
            master_port, metrics_port, lender_port = _free_port(), _free_port(), _free_port()
            master = procs.spawn(
                [master_bin, f"--rpc_address={LOOPBACK}", f"--rpc_port={master_port}",
                 f"--metrics_host={LOOPBACK}", f"--metrics_port={metrics_port}",
                 "--enable_metric_reporting=false", f"--default_kv_lease_ttl={lease_ttl_ms}"],
                "master.log", env,
            )
            _wait_port(master_port, deadline, master, "mooncake_master", procs.dir / "master.log")
            lender = procs.spawn(
                [lender_bin, f"--host={LOOPBACK}", f"--port={lender_port}",
                 f"--global_segment_size={segment_bytes}", f"--master_server_address={LOOPBACK}:{master_port}",
                 "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"],
                "lender.log", env,
            )
            _wait_port(lender_port, deadline, lender, "mooncake_client", procs.dir / "lender.log")
        except BaseException:
            procs.stop()
            raise
        return cls(procs, master_port, master, lender)

    @property
    def master_address(self) -> str:
        """``127.0.0.1:port`` of the master."""
        return f"{LOOPBACK}:{self.master_port}"

    def config(self, **overrides: Any) -> MooncakeConfig:
        """A :class:`MooncakeConfig` for this cluster (fields overridden by keyword)."""
        return MooncakeConfig(master_address=self.master_address, **overrides)

    def raw_client(self) -> Any:
        """A plain ``MooncakeDistributedStore`` joined to this cluster (the caller closes it)."""
        module: Any = importlib.import_module("mooncake.store")
        store = module.MooncakeDistributedStore()
        rc = store.setup(LOOPBACK, "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", self.master_address)
        if rc != 0:
            raise ServiceError(f"a raw Mooncake client could not join {self.master_address} ({rc})")
        return store


class RedisClusterServices(_ServiceGroup):
    """``nodes`` Redis servers in cluster mode on 127.0.0.1, all slots covered, no replicas.

    Owns the servers and the temporary directory (their cluster configs and logs). Create with
    :meth:`start`; release with :meth:`stop` (idempotent; also a context manager).
    """

    def __init__(self, procs: _Processes, ports: list[int]) -> None:
        self._procs = procs
        self.ports = ports

    @classmethod
    def start(
        cls,
        *,
        nodes: int = 3,
        maxmemory_bytes: int = 256 << 20,
        policy: str = "allkeys-lru",
        timeout: float = 30.0,
        require_full_coverage: bool = True,
    ) -> RedisClusterServices:
        """Start the servers, join them into one cluster and wait until it reports ``ok``.

        ``require_full_coverage=False`` starts them with ``cluster-require-full-coverage no``: the
        live nodes keep serving their slots once a node has failed.

        Raises:
            ServiceError: ``redis-server``/``redis-cli`` missing, a server that did not listen, or a
                cluster that did not become ``ok`` in ``timeout`` (everything started is stopped).
        """
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise ServiceError("redis-server and redis-cli are needed (apt-get install -y redis-server)")
        procs = _Processes("kvoffload-redis-")
        deadline = time.monotonic() + timeout
        try:
            ports: list[int] = []
            for _ in range(nodes):
                port = _free_port(bus=True)
                while port in ports:
                    port = _free_port(bus=True)
                ports.append(port)
                procs.spawn(
                    [server, "--port", str(port), "--bind", LOOPBACK, "--cluster-enabled", "yes",
                     "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "2000",
                     "--dir", str(procs.dir), "--save", "", "--appendonly", "no",
                     "--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", policy,
                     "--cluster-require-full-coverage", "yes" if require_full_coverage else "no",
                     "--daemonize", "no"],
                    f"redis-{port}.log",
                )
            for port, proc in zip(ports, procs.procs):
                _wait_port(port, deadline, proc, "redis-server", procs.dir / f"redis-{port}.log")
            create = subprocess.run(
                [cli, "--cluster", "create", *[f"{LOOPBACK}:{p}" for p in ports],
                 "--cluster-replicas", "0", "--cluster-yes"],
                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=max(1.0, deadline - time.monotonic()), check=False,
            )
            if create.returncode != 0:
                raise ServiceError(f"redis-cli --cluster create failed: {create.stdout[-500:]} {create.stderr[-500:]}")
            services = cls(procs, ports)
            services._wait_ok(cli, deadline)
        except subprocess.TimeoutExpired as exc:
            procs.stop()
            raise ServiceError(f"redis-cli did not finish in time: {exc}") from exc
        except BaseException:
            procs.stop()
            raise
        return services

    def _wait_ok(self, cli: str, deadline: float) -> None:
        pending = list(self.ports)
        while pending and time.monotonic() < deadline:
            port = pending[0]
            info = subprocess.run(
                [cli, "-h", LOOPBACK, "-p", str(port), "cluster", "info"], stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=5, check=False,
            )
            if "cluster_state:ok" in info.stdout:
                pending.pop(0)
            else:
                time.sleep(_POLL_S)
        if pending:
            raise ServiceError(f"the Redis cluster did not report cluster_state:ok on port {pending[0]} in time")

    def kill_node(self, index: int) -> None:
        """SIGKILL the server of ``nodes[index]`` by its pid (its files stay until ``stop``)."""
        proc = self._procs.procs[index]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(_STOP_GRACE_S)

    @property
    def nodes(self) -> tuple[tuple[str, int], ...]:
        """``(host, port)`` of every node."""
        return tuple((LOOPBACK, p) for p in self.ports)

    def config(self, **overrides: Any) -> RedisClusterConfig:
        """A :class:`RedisClusterConfig` for this cluster (fields overridden by keyword)."""
        return RedisClusterConfig(nodes=self.nodes, **overrides)

    def raw_client(self) -> Any:
        """A plain ``redis.cluster.RedisCluster`` for this cluster (the caller closes it)."""
        module: Any = importlib.import_module("redis.cluster")
        return module.RedisCluster(
            startup_nodes=[module.ClusterNode(h, p) for h, p in self.nodes], socket_timeout=10
        )

