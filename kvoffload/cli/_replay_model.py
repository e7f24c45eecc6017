"""The replay's model: its configuration, the workload (request chains of block keys), the
key-derived byte patterns that make every loaded block verifiable, and the report. Pure data and
torch arithmetic; the engine that runs it is :mod:`kvoffload.cli._replay_engine`.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Final

import attrs
import numpy as np
import torch

from kvoffload import (
    POLICY_NAMES,
    BackendName,
    InvalidArgumentError,
    PathName,
)
from kvoffload import DeviceLayout
from kvoffload.cli._caches import LAYOUTS

__all__ = [
    "DISK_FAILURE_COUNTERS",
    "EXIT_FAILED",
    "EXIT_OK",
    "REMOTES",
    "PatternGenerator",
    "ReplayConfig",
    "ReplayReport",
    "Workload",
    "block_key",
    "key_seed",
]

DTYPES: Final = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: ``--disk-direct``: the value of ``DiskConfig.direct`` (None: O_DIRECT where the file system takes it).
DISK_DIRECT: Final[dict[str, bool | None]] = {"auto": None, "on": True, "off": False}
#: DiskStats counters of failures, reported by name (a failed system call or record check each count).
DISK_FAILURE_COUNTERS: Final = (
    "short_reads", "short_writes", "eio", "enospc", "os_errors", "checksum_mismatches", "header_invalid",
    "block_mismatches", "generation_mismatches", "not_valid", "fingerprint_mismatches",
)
#: The remote stores the replay can use.
REMOTES: Final = ("mooncake", "redis")
#: Key length in bytes (a blake2b digest).
KEY_BYTES: Final = 16
#: Written into every load destination first, so that a load that copies nothing is caught.
POISON_BYTE: Final = 0xA5
#: Longest wait for one job before the run is aborted (its loads are then unverified).
WAIT_TIMEOUT_S: Final = 120.0
#: Seconds between progress lines on stderr.
PROGRESS_INTERVAL_S: Final = 2.0
#: Default prefill rate of the simulated model, tokens per second (an assumption: an 8B-class model
#: on one current datacenter GPU prefills on the order of 10^4 tokens/s; pass your own).
DEFAULT_PREFILL_TOKENS_PER_S: Final = 20_000.0
#: Blocks per pattern / verification kernel batch (bounds the int64 scratch: 8 bytes per word).
CHUNK_BLOCKS: Final = 256
#: Verification results kept on the device before they are read back (each read syncs the stream).
_DRAIN_BATCHES: Final = 512
#: Corrupted blocks described in the report (the count is always exact).
_MAX_EXAMPLES: Final = 8
_GB: Final = 1e9
_M32: Final = 0xFFFFFFFF
_TWO32: Final = 1 << 32
_TWO31: Final = 1 << 31
_HALF_MASK: Final = (1 << 30) - 1
_SALT_MUL: Final = 0x9E3779B1  # odd (golden ratio): j -> j * _SALT_MUL mod 2**30 is a bijection
_KEY_PERSON: Final = b"kvoffload.replay"  # blake2b personalisation, at most 16 bytes
_SEED_PERSON: Final = b"kvoffload.patt"
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


# ------------------------------------------------------------------------------------ configuration


@attrs.frozen
class ReplayConfig:
    """Everything one replay run needs; the defaults are the host backend's (small) ones.

    Sizes are in blocks unless the name says otherwise. ``requests == 0`` means "no request limit";
    the run then stops once ``blocks_to_load`` block loads were submitted (or after that many
    requests, for a workload that loads less than one block per request). ``max_seconds == 0``: no
    time limit. ``disk_path`` None: no disk tier (``disk_blocks`` must then be 0); else the tier file
    (its directory must exist) with ``disk_blocks`` records, opened with ``DISK_DIRECT[disk_direct]``,
    and with ``disk_reuse`` opened warm: the manager adopts the records an earlier run of the same
    layout demoted (``Manager.adopt_disk``), and they are served and verified as disk hits.
    ``settle``: one request at a time, its loads, compute, stores and demotions all finished before
    the next is admitted — the manager then sees the same sequence on every run, so hit rates are
    reproducible (throughput is not representative). ``remote`` (``"mooncake"`` or ``"redis"``): a
    remote tier on the store at ``remote_address`` (a Mooncake master ``host:port``, or Redis
    Cluster nodes ``host:port,...``): every completed store is written through to it, and lookups
    past the local tiers load from it.
    """

    backend: BackendName = "auto"
    path: PathName = "auto"
    layout: str = "per-layer"
    layers: int = 2
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    device_blocks: int = 512
    host_blocks: int = 1024
    policy: str = "lru"
    requests: int = 0
    blocks_to_load: int = 5_000
    max_seconds: float = 0.0
    documents: int = 200
    zipf: float = 1.0
    system_blocks: int = 2
    doc_blocks_min: int = 4
    doc_blocks_max: int = 32
    suffix_blocks_min: int = 1
    suffix_blocks_max: int = 8
    continue_prob: float = 0.35
    max_conversations: int = 256
    max_request_blocks: int = 96
    inflight_requests: int = 16
    settle: bool = False
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    stall_cycles_per_block: int = 0
    seed: int = 0
    disk_path: str | None = None
    disk_blocks: int = 0
    disk_direct: str = "auto"
    disk_reuse: bool = False
    remote: str | None = None
    remote_address: str = ""

    def check(self) -> None:
        """Raise :class:`InvalidArgumentError` naming the first bad field."""
        positive = ("layers", "kv_heads", "head_dim", "block_size", "device_blocks", "host_blocks",
                    "documents", "doc_blocks_min", "suffix_blocks_min", "max_conversations",
                    "max_request_blocks", "inflight_requests")
        for name in positive:
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} = {getattr(self, name)} must be >= 1")
        for name in ("requests", "blocks_to_load", "system_blocks", "stall_cycles_per_block", "seed"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} = {getattr(self, name)} must be >= 0")
        if self.requests == 0 and self.blocks_to_load == 0:
            raise InvalidArgumentError("requests = 0 and blocks_to_load = 0: give one of them a limit")
        if self.max_seconds < 0:
            raise InvalidArgumentError(f"max_seconds = {self.max_seconds} must be >= 0 (0: no limit)")
        for low, high in (("doc_blocks_min", "doc_blocks_max"), ("suffix_blocks_min", "suffix_blocks_max")):
            if getattr(self, high) < getattr(self, low):
                raise InvalidArgumentError(
                    f"{high} = {getattr(self, high)} must be >= {low} = {getattr(self, low)}"
                )
        shortest = self.system_blocks + self.doc_blocks_max + self.suffix_blocks_max
        if self.max_request_blocks < shortest:
            raise InvalidArgumentError(
                f"max_request_blocks = {self.max_request_blocks} must be >= system_blocks + "
                f"doc_blocks_max + suffix_blocks_max = {shortest} (a first turn must fit)"
            )
        if self.device_blocks < self.max_request_blocks:
            raise InvalidArgumentError(
                f"device_blocks = {self.device_blocks} must be >= max_request_blocks = "
                f"{self.max_request_blocks}: a request holds a device block per block"
            )
        if not 0.0 <= self.continue_prob <= 1.0:
            raise InvalidArgumentError(f"continue_prob = {self.continue_prob} must be in [0, 1]")
        if self.zipf < 0:
            raise InvalidArgumentError(f"zipf = {self.zipf} must be >= 0 (0: uniform)")
        if not self.prefill_tokens_per_s > 0:
            raise InvalidArgumentError(f"prefill_tokens_per_s = {self.prefill_tokens_per_s} must be > 0")
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout = {self.layout!r} must be one of {', '.join(LAYOUTS)}")
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype = {self.dtype!r} must be one of {', '.join(DTYPES)}")
        if self.policy not in POLICY_NAMES:
            raise InvalidArgumentError(f"policy = {self.policy!r} must be one of {sorted(POLICY_NAMES)}")
        self._check_disk()
        if self.remote is not None:
            if self.disk_reuse:
                raise InvalidArgumentError(
                    "disk_reuse with remote: instance B would open instance A's tier file warm and read "
                    "A's blocks from it, not from the store"
                )
            if self.remote not in REMOTES:
                raise InvalidArgumentError(f"remote = {self.remote!r} must be one of {', '.join(REMOTES)}")
            if not self.remote_address:
                raise InvalidArgumentError(f"remote = {self.remote!r} needs remote_address (the store's)")
        elif self.remote_address:
            raise InvalidArgumentError("remote_address needs remote (mooncake or redis)")

    def _check_disk(self) -> None:
        if self.disk_direct not in DISK_DIRECT:
            raise InvalidArgumentError(
                f"disk_direct = {self.disk_direct!r} must be one of {', '.join(DISK_DIRECT)}"
            )
        if self.disk_path is None:
            if self.disk_blocks or self.disk_direct != "auto" or self.disk_reuse:
                raise InvalidArgumentError(
                    f"disk_blocks = {self.disk_blocks}, disk_direct = {self.disk_direct!r}, disk_reuse = "
                    f"{self.disk_reuse} need disk_path (the disk tier's file)"
                )
            return
        if self.disk_blocks < 1:
            raise InvalidArgumentError(
                f"disk_blocks = {self.disk_blocks} must be >= 1 with disk_path = {self.disk_path!r}"
            )
        if not self.disk_path or os.path.isdir(self.disk_path):
            raise InvalidArgumentError(
                f"disk_path = {self.disk_path!r} must be a file path (not a directory)"
            )
        parent = os.path.dirname(os.path.abspath(self.disk_path))
        if not os.path.isdir(parent):
            raise InvalidArgumentError(
                f"disk_path = {self.disk_path!r}: its directory {parent!r} does not exist"
            )


# ------------------------------------------------------------------------------------------- workload


def block_key(parent: bytes, position: int, content: bytes) -> bytes:
    """The key of the block at ``position`` after the chain ending in ``parent`` (b"" for none),
    holding the tokens named by ``content``: a :data:`KEY_BYTES`-byte blake2b digest."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_KEY_PERSON)
    h.update(parent)
    h.update(position.to_bytes(4, "little"))
    h.update(content)
    return h.digest()


def _extend(chain: list[bytes], contents: Iterator[bytes]) -> None:
    for content in contents:
        chain.append(block_key(chain[-1] if chain else b"", len(chain), content))


@attrs.define(eq=False)
class _Conversation:
    cid: int
    keys: list[bytes]
    turns: int = 1


class Workload:
    """Generates the request key chains (see the module docstring); deterministic for a seed.

    Owns a numpy generator, the documents' key chains and the active conversations.
    """

    def __init__(self, config: ReplayConfig) -> None:
        self._config = config
        self._rng = np.random.default_rng(config.seed)
        self._system: list[bytes] = []
        _extend(self._system, (b"sys" + i.to_bytes(4, "little") for i in range(config.system_blocks)))
        lengths = self._rng.integers(config.doc_blocks_min, config.doc_blocks_max + 1, config.documents)
        self._doc_lengths = [int(n) for n in lengths]
        self._docs: dict[int, tuple[bytes, ...]] = {}
        weights = (np.arange(config.documents, dtype=np.float64) + 1.0) ** -config.zipf
        self._cdf = list(np.cumsum(weights / weights.sum()))
        self._active: deque[_Conversation] = deque(maxlen=config.max_conversations)
        self._next_cid = 0
        self.continued = 0

    def document(self, doc: int) -> tuple[bytes, ...]:
        """The key chain of the system prompt followed by document ``doc``."""
        chain = self._docs.get(doc)
        if chain is None:
            keys = list(self._system)
            d = doc.to_bytes(4, "little")
            _extend(keys, (b"doc" + d + i.to_bytes(4, "little") for i in range(self._doc_lengths[doc])))
            chain = self._docs[doc] = tuple(keys)
        return chain

    def next_request(self) -> tuple[bytes, ...]:
        """The key chain of the next request."""
        c = self._config
        suffix = int(self._rng.integers(c.suffix_blocks_min, c.suffix_blocks_max + 1))
        if self._active and self._rng.random() < c.continue_prob:
            conv = self._active[int(self._rng.integers(len(self._active)))]
            if len(conv.keys) + suffix <= c.max_request_blocks:
                self._turn(conv, suffix)
                self.continued += 1
                return tuple(conv.keys)
            self._active.remove(conv)
        doc = min(bisect.bisect_left(self._cdf, self._rng.random()), c.documents - 1)
        conv = _Conversation(self._next_cid, list(self.document(doc)))
        self._next_cid += 1
        self._turn(conv, suffix)
        self._active.append(conv)
        return tuple(conv.keys)

    def _turn(self, conv: _Conversation, blocks: int) -> None:
        tag = b"turn" + conv.cid.to_bytes(8, "little") + conv.turns.to_bytes(4, "little")
        _extend(conv.keys, (tag + j.to_bytes(4, "little") for j in range(blocks)))
        conv.turns += 1


# ------------------------------------------------------------------------------------ patterns


def key_seed(key: bytes) -> int:
    """The 64-bit pattern seed of ``key``."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=_SEED_PERSON).digest(), "little")


class PatternGenerator:
    """Builds the expected record of keys on the layout's device (see the module docstring).

    Owns small device tensors: the per-word multipliers, the record's padding mask (None without
    padding) and a poison record. Runs its kernels on the caller's current stream.
    """

    def __init__(self, layout: DeviceLayout) -> None:
        self.layout = layout
        self.device = layout.device
        words = torch.arange(layout.record_bytes // 4, dtype=torch.int64, device=self.device)
        # Distinct odd multipliers below 2**31: a bijection of the word index, times 2, plus 1.
        self._odd = words.mul_(_SALT_MUL).bitwise_and_(_HALF_MASK).mul_(2).add_(1).unsqueeze(0)
        payload = torch.zeros(layout.record_bytes, dtype=torch.bool)
        table = layout.page_table
        for offset, size in zip(table.host_offset.tolist(), table.nbytes.tolist()):
            payload[offset : offset + size] = True
        padding = ~payload
        self._padding = padding.to(self.device) if bool(padding.any()) else None
        self._poison = torch.full((1, layout.record_bytes), POISON_BYTE, dtype=torch.uint8, device=self.device)

    def to_device(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the device, without synchronising the current stream."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def records(self, keys: Sequence[bytes]) -> torch.Tensor:
        """The expected records of ``keys``: ``uint8 [len(keys), record_bytes]``, padding zero."""
        seeds = self.to_device([s for key in keys for s in divmod(key_seed(key), _TWO32)]).view(-1, 2)
        hi, lo = seeds[:, 0:1].bitwise_or(1), seeds[:, 1:2]
        # < 2**31 * 2**32 + 2**32 < 2**63: no int64 overflow. Then [0, 2**32) -> int32 range, exactly.
        x = torch.mul(self._odd, hi).add_(lo).bitwise_and_(_M32).sub_(_TWO31)
        out = x.to(torch.int32).view(torch.uint8)
        return out if self._padding is None else out.masked_fill_(self._padding, 0)

    def write(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Write the keys' patterns into device ``blocks`` (the replay's "compute")."""
        for at in range(0, len(blocks), CHUNK_BLOCKS):
            chunk = self.to_device(blocks[at : at + CHUNK_BLOCKS])
            self.layout.scatter_records(chunk, self.records(keys[at : at + CHUNK_BLOCKS]))

    def poison(self, blocks: Sequence[int]) -> None:
        """Fill device ``blocks`` with :data:`POISON_BYTE`."""
        for at in range(0, len(blocks), CHUNK_BLOCKS):
            chunk = self.to_device(blocks[at : at + CHUNK_BLOCKS])
            self.layout.scatter_records(chunk, self._poison.expand(chunk.shape[0], -1))

    def mismatches(self, blocks: Sequence[int], keys: Sequence[bytes]) -> torch.Tensor:
        """A bool device tensor, True for each block whose bytes differ from its key's pattern."""
        flags = []
        for at in range(0, len(blocks), CHUNK_BLOCKS):
            got = self.layout.gather_records(self.to_device(blocks[at : at + CHUNK_BLOCKS]))
            flags.append((got != self.records(keys[at : at + CHUNK_BLOCKS])).any(dim=1))
        return torch.cat(flags)


# ------------------------------------------------------------------------------------------- report


@attrs.frozen
class ReplayReport:
    """What one replay measured. Block counts count blocks; bytes count payload bytes of ok jobs.

    The ``*_by_tier`` maps have a key per configured tier (``"host"``, and ``"disk"`` with a disk
    tier): ``hits_by_tier`` its verified hit blocks, ``hit_rate_by_tier`` those over blocks looked up,
    ``load_jobs_by_tier`` / ``failed_load_jobs_by_tier`` / ``failed_load_blocks_by_tier`` its load
    jobs and the failed ones (their blocks were recomputed), ``bytes_loaded_by_tier`` and
    ``load_gbps_by_tier`` what its successful loads moved. ``hit_rate`` is verified hits over blocks
    looked up (all tiers); ``manager_hit_rate`` is the manager's own lookup figure (it counts a hit
    before the load, so it includes failed loads). ``overlap_fraction``: the share of compute batches
    issued while a copy job was in flight.

    Disk fields (zero or empty without a disk tier): ``disk_io`` is the demotions' transfer path
    (``"disk-direct"`` or ``"disk-buffered"``; "" before any); ``demoted_blocks`` / ``bytes_demoted``
    count successful demotions, ``demote_failed_blocks`` / ``failed_demote_jobs`` the failed ones (never
    loadable from disk); ``disk_bytes_written`` / ``disk_bytes_read``, ``disk_write_gbps`` /
    ``disk_read_gbps`` (over the tier's summed request times) and ``disk_failures`` (by
    :data:`DISK_FAILURE_COUNTERS` name) are the disk tier's own counters.

    Remote fields (zero or empty without a remote tier): ``remote`` names the store; the
    ``"remote"`` tier of the ``*_by_tier`` maps counts the hits read from it (read into a host block,
    then loaded, then verified); ``remote_put_*`` count the write-through puts (blocks put; refused
    because the store was full, which is not a failure: those blocks are just not shared; failed);
    ``remote_lookup_errors`` the existence checks that failed or passed their deadline (misses);
    ``remote_failures`` the remote tier's failed keys by kind.
    """

    backend: str
    path: str
    policy: str
    device: str
    record_bytes: int
    block_bytes: int
    block_tokens: int
    device_blocks: int
    host_blocks: int
    requests: int
    continued_requests: int
    lookup_blocks: int
    hit_blocks: int
    hits_by_tier: dict[str, int]
    hit_rate_by_tier: dict[str, float]
    load_jobs_by_tier: dict[str, int]
    failed_load_jobs_by_tier: dict[str, int]
    failed_load_blocks_by_tier: dict[str, int]
    bytes_loaded_by_tier: dict[str, int]
    load_gbps_by_tier: dict[str, float]
    hit_rate: float
    manager_hit_rate: float
    computed_blocks: int
    failed_load_blocks: int
    load_jobs: int
    store_jobs: int
    blocks_loaded: int
    blocks_stored: int
    store_failed_blocks: int
    stores_skipped_blocks: int
    host_evictions: int
    bytes_loaded: int
    bytes_stored: int
    load_gbps: float
    store_gbps: float
    load_wall_gbps: float
    store_wall_gbps: float
    wall_s: float
    load_busy_s: float
    store_busy_s: float
    overlap_fraction: float
    prefill_tokens_per_s: float
    hit_tokens: int
    recompute_s: float
    prefill_saved_s: float
    verified_blocks: int
    corrupted_blocks: int
    unverified_blocks: int
    failed_load_jobs: int
    failed_store_jobs: int
    disk_path: str
    disk_blocks: int
    disk_reuse: bool
    disk_adopted_blocks: int
    disk_io: str
    disk_evictions: int
    demote_jobs: int
    demoted_blocks: int
    bytes_demoted: int
    demote_busy_s: float
    demote_failed_blocks: int
    failed_demote_jobs: int
    disk_bytes_written: int
    disk_bytes_read: int
    disk_write_gbps: float
    disk_read_gbps: float
    disk_failures: dict[str, int]
    remote: str
    remote_put_jobs: int
    remote_put_blocks: int
    remote_put_failed_blocks: int
    failed_remote_put_jobs: int
    remote_put_refused_blocks: int
    remote_lookup_errors: int
    remote_failures: dict[str, int]
    events: dict[str, int]
    target_blocks: int
    target_reached: bool
    corrupted_examples: tuple[str, ...]
    errors: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """No corrupted or unverified block, no failed job, no error."""
        return (self.corrupted_blocks == 0 and self.unverified_blocks == 0 and self.failed_load_jobs == 0
                and self.failed_store_jobs == 0 and self.failed_demote_jobs == 0
                and self.failed_remote_put_jobs == 0 and not self.errors)

    def failures(self) -> list[str]:
        """Why the run is not ok (empty when it is)."""
        out = []
        if self.corrupted_blocks:
            out.append(f"{self.corrupted_blocks} corrupted blocks")
        if self.unverified_blocks:
            out.append(f"{self.unverified_blocks} loaded blocks not verified")
        failed = (self.failed_load_jobs, self.failed_store_jobs, self.failed_demote_jobs,
                  self.failed_remote_put_jobs)
        if any(failed):
            out.append(f"failed jobs: {self.failed_load_jobs} load, {self.failed_store_jobs} store, "
                       f"{self.failed_demote_jobs} demote, {self.failed_remote_put_jobs} remote put")
        out.extend(self.errors)
        return out

    def to_json(self) -> dict[str, object]:
        """The report as JSON-ready values, with ``ok``."""
        data = attrs.asdict(self)
        data["corrupted_examples"] = list(self.corrupted_examples)
        data["errors"] = list(self.errors)
        data["ok"] = self.ok
        return data
