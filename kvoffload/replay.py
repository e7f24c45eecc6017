"""``python -m kvoffload replay``: an engine-shaped workload through Manager + Worker, every load verified.

What it simulates. An inference engine with a paged device KV cache, a scheduler-side
:class:`~kvoffload.manager.Manager` over a pinned host pool and a :class:`~kvoffload.Worker` that moves
the bytes. Requests arrive one after another; each is a chain of KV blocks:

* a *system prompt* shared by every request (``--system-blocks``),
* a *document* drawn from a pool of ``--documents`` with a Zipf(``--zipf``) skew (document ``d`` has
  weight ``(d + 1) ** -s``), ``--doc-blocks-min`` .. ``--doc-blocks-max`` blocks long,
* a unique suffix of ``--suffix-blocks-min`` .. ``--suffix-blocks-max`` blocks (the user's turn);

or, with probability ``--continue-prob``, the next turn of an active conversation: its whole previous
chain plus a new unique suffix (multi-turn reuse), until it would exceed ``--max-request-blocks``. A
block's key is ``blake2b(parent key, position, content id)`` (16 bytes), so equal prefixes have equal
keys and a key names its whole prefix.

Each request follows the Manager's protocol: ``lookup`` gives the ready prefix; those blocks are hits:
``prepare_load``, the destination device blocks are poisoned on the compute stream, ``Worker.load``
(ordered after the compute stream), and on completion the blocks are verified and ``complete_load`` is
called (with a disk tier, per tier: see below). A failed load is a miss: its blocks are recomputed,
never counted or verified as hits (counting a failed load as loaded would serve another request's
KV). The misses are "computed": the compute stream writes every byte of each
block with the key's pattern; then ``prepare_store`` (None: the pool has no room now, the blocks are
not offloaded) and ``Worker.store`` ordered after those writes (``stream=`` the compute stream),
``complete_store(plan, ok)`` when its result arrives; evictions happen inside the manager. Device
blocks come from a free list (last freed, first reused, to stress recycling): a block is recycled only
after its store finished, and a loaded block is read only after its load finished. Up to
``--inflight-requests`` wait for loads at once; the loop submits and keeps going, polling the Worker
every step, so loads and stores overlap the compute of other requests. On the cuda backend the compute
stream is a real side stream and every kernel of the replay (poison, pattern, verification) runs on it;
on the host backend it is the program order of the main thread while the Worker copies on its threads.

Disk tier (``--disk-path``, ``--disk-blocks``). The manager gets a disk pool and the Worker a disk tier
(:class:`~kvoffload.disk.DiskConfig`; the file is created, or recreated empty, and left in place).
Host eviction then demotes to disk as the manager's sequence says: each ``StorePlan.demotions`` is one
``Worker.demote`` job, and the store into those host blocks is submitted only once the demotion's
result came back (it read them), after ``complete_demote(plan, ok)``; a failed demotion is never
loadable from disk. Meanwhile the loop goes on, so demotions overlap compute as well. A request's hits
are loaded per tier: one ``Worker.load`` job for its host hits and one ``Worker.load_from_disk`` job
for its disk hits (``LoadPlan.tiers``), each completed in the manager (``complete_load`` of its keys)
when its result arrives. Blocks of a job that succeeded are verified as hits of that tier; blocks of a
failed job (an I/O error, a record failing its checksum) are recomputed misses, whichever tier; the
job is completed in the manager with ``ok=False``, which drops the keys' disk copies, so a record
that failed its check is never offered again.

Verification. A key's pattern fills the whole record: with ``lo``, ``hi`` the 32-bit halves of the
key's 64-bit seed (a blake2b digest of the key), 32-bit word ``j`` of the record is
``(t_j * (hi | 1) + lo) mod 2**32``, where the ``t_j`` are distinct odd constants, computed with torch
integer ops on the layout's device. For a fixed ``j`` the word is injective in ``lo`` (and in ``hi``
but for its lowest bit), so a block of another key, a stale block or a torn one differs in almost every
word; within one record distinct ``t_j`` times an odd number give distinct words, so a page copied to
the wrong offset is caught too, and so is a single flipped byte. Every loaded block is compared byte
for byte (padding excluded) with the pattern regenerated on the same device, on the compute stream,
after its load completed; mismatches are counted as corrupted blocks. A block whose load was submitted
but that was neither verified nor reported failed (the run aborted) is counted as unverified. Loads
write into blocks poisoned first, so a load that copies nothing is caught as well. The exit status is
0 only with no corrupted block, no unverified block, no failed job (load from either tier, store or
demotion: each was handled safely, but none should fail on healthy hardware) and a clean shutdown.

Prefill model (an estimate, stated): a verified hit saves recomputing its tokens. With ``T`` hit
tokens (verified hit blocks x block size), a prefill rate ``R`` (``--prefill-tokens-per-s``, tokens per
second of the model whose KV geometry is simulated) and ``L`` the load time (the summed copy time of
the host loads, plus the wall time during which disk loads were in flight: the disk pipeline runs its
jobs one after another, so their own times would count the queueing), the saving is ``T / R - L``. It
assumes every load is on the critical path (none hidden behind compute) and a rate that does not
fall with context length; both make it conservative. ``R`` must be the rate of a model with the
simulated geometry: with fewer layers than the real model (the small default), the loads move fewer
bytes per token than the real model's would, and ``L`` is too small in proportion.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Final, TextIO

import attrs
import numpy as np
import torch

from kvoffload._caches import LAYOUTS, build_cache
from kvoffload.backends import new_stream
from kvoffload.disk import DiskConfig, DiskStats
from kvoffload.errors import DiskError, InvalidArgumentError, KVOffloadError
from kvoffload.layout import DeviceLayout
from kvoffload.manager import POLICY_NAMES, EventKind, LoadPlan, Manager, StorePlan, Tier
from kvoffload.records import Direction, TransferResult
from kvoffload.worker import BackendName, PathName, Worker

__all__ = [
    "LAYOUTS",
    "ReplayConfig",
    "ReplayReport",
    "Workload",
    "add_arguments",
    "block_key",
    "config_from_args",
    "main",
    "print_report",
    "run_replay",
]

DTYPES: Final = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: ``--disk-direct``: the value of ``DiskConfig.direct`` (None: O_DIRECT where the file system takes it).
DISK_DIRECT: Final[dict[str, bool | None]] = {"auto": None, "on": True, "off": False}
#: DiskStats counters of failures, reported by name (a failed system call or record check each count).
DISK_FAILURE_COUNTERS: Final = (
    "short_reads", "short_writes", "eio", "enospc", "os_errors", "checksum_mismatches", "header_invalid",
    "block_mismatches", "generation_mismatches", "not_valid", "fingerprint_mismatches",
)
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
    (its directory must exist) with ``disk_blocks`` records, opened with ``DISK_DIRECT[disk_direct]``.
    ``settle``: one request at a time, its loads, compute, stores and demotions all finished before
    the next is admitted — the manager then sees the same sequence on every run, so hit rates are
    reproducible (throughput is not representative).
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

    def _check_disk(self) -> None:
        if self.disk_direct not in DISK_DIRECT:
            raise InvalidArgumentError(
                f"disk_direct = {self.disk_direct!r} must be one of {', '.join(DISK_DIRECT)}"
            )
        if self.disk_path is None:
            if self.disk_blocks or self.disk_direct != "auto":
                raise InvalidArgumentError(
                    f"disk_blocks = {self.disk_blocks}, disk_direct = {self.disk_direct!r} need "
                    "disk_path (the disk tier's file)"
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
    events: dict[str, int]
    target_blocks: int
    target_reached: bool
    corrupted_examples: tuple[str, ...]
    errors: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """No corrupted or unverified block, no failed job, no error."""
        return (self.corrupted_blocks == 0 and self.unverified_blocks == 0 and self.failed_load_jobs == 0
                and self.failed_store_jobs == 0 and self.failed_demote_jobs == 0 and not self.errors)

    def failures(self) -> list[str]:
        """Why the run is not ok (empty when it is)."""
        out = []
        if self.corrupted_blocks:
            out.append(f"{self.corrupted_blocks} corrupted blocks")
        if self.unverified_blocks:
            out.append(f"{self.unverified_blocks} loaded blocks not verified")
        if self.failed_load_jobs or self.failed_store_jobs or self.failed_demote_jobs:
            out.append(f"failed jobs: {self.failed_load_jobs} load, {self.failed_store_jobs} store, "
                       f"{self.failed_demote_jobs} demote")
        out.extend(self.errors)
        return out

    def to_json(self) -> dict[str, object]:
        """The report as JSON-ready values, with ``ok``."""
        data = attrs.asdict(self)
        data["corrupted_examples"] = list(self.corrupted_examples)
        data["errors"] = list(self.errors)
        data["ok"] = self.ok
        return data


# ------------------------------------------------------------------------------------------- engine


@attrs.define(eq=False)
class _Request:
    rid: int
    keys: tuple[bytes, ...]
    device_blocks: list[int]
    hits: int
    load_plan: LoadPlan | None = None
    loads_pending: int = 0
    #: Positions among the hits whose load failed: recomputed with the misses, never verified.
    failed: list[int] = attrs.field(factory=list)

    def computed_positions(self) -> list[int]:
        """The positions the compute stream writes: failed loads, then the misses (request order)."""
        return sorted(self.failed) + list(range(self.hits, len(self.keys)))


@attrs.define(eq=False)
class _LoadJob:
    request: _Request
    tier: Tier
    positions: list[int]


@attrs.define(eq=False)
class _StoreJob:
    plan: StorePlan
    device_blocks: list[int]


@attrs.define(eq=False)
class _DemoteJob:
    """The demotions of ``store.plan``; the store is submitted once they no longer read its host blocks."""

    store: _StoreJob


@attrs.define(eq=False)
class _TierLoads:
    """Load counters of one tier; ``busy_s`` is summed copy time (host), or the wall time with a load
    in flight (disk: its jobs queue behind each other, so their own times would overlap)."""

    jobs: int = 0
    hits: int = 0
    failed_jobs: int = 0
    failed_blocks: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    in_flight: int = 0
    busy_since: float = 0.0


class _Replay:
    """One run: the scheduler loop over a Manager and a Worker (both borrowed), counting as it goes."""

    def __init__(
        self, config: ReplayConfig, layout: DeviceLayout, manager: Manager, worker: Worker,
        compute: torch.cuda.Stream | None, progress: TextIO | None,
    ) -> None:
        self.c = config
        self.layout = layout
        self.manager = manager
        self.worker = worker
        self.compute = compute
        self.progress = progress
        self.patterns = PatternGenerator(layout)
        self.workload = Workload(config)
        self.free: list[int] = list(range(layout.num_blocks - 1, -1, -1))
        self.jobs: dict[int, _LoadJob | _StoreJob | _DemoteJob] = {}
        self.ready: list[_Request] = []
        self.next_job = 0
        self.next_request: tuple[bytes, ...] | None = None
        self.checks: list[tuple[list[int], tuple[bytes, ...], torch.Tensor]] = []
        self.requests = 0
        self.lookup_blocks = 0
        tiers = [Tier.HOST] + ([Tier.DISK] if manager.num_disk_blocks else [])
        self.tiers = {tier: _TierLoads() for tier in tiers}
        self.load_submitted = 0
        self.verified = 0
        self.corrupted = 0
        self.examples: list[str] = []
        self.computed = 0
        self.failed_load_blocks = 0
        self.failed_loads = 0
        self.failed_stores = 0
        self.store_failed_blocks = 0
        self.stores_skipped = 0
        self.load_jobs = 0
        self.store_jobs = 0
        self.blocks_loaded = 0
        self.blocks_stored = 0
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.store_busy_s = 0.0
        self.demote_jobs = 0
        self.demoted_blocks = 0
        self.bytes_demoted = 0
        self.demote_busy_s = 0.0
        self.demote_failed_blocks = 0
        self.failed_demotes = 0
        self.disk_io = ""
        self.compute_batches = 0
        self.overlapped_batches = 0
        self.events = {kind.value: 0 for kind in EventKind}
        self.errors: list[str] = []
        self.deadline = float("inf")

    # ------------------------------------------------------------------ main loop

    def run(self) -> float:
        """Run until the limits are reached and every job drained; return the wall seconds."""
        start = time.perf_counter()
        last_progress = start
        self.deadline = start + self.c.max_seconds if self.c.max_seconds else float("inf")
        while True:
            admitting = self._admitting()
            if not admitting and not self.jobs and not self.ready:
                break
            progressed = self._handle(self.worker.poll())
            settled = not self.c.settle or (not self.jobs and not self.ready)
            progressed |= admitting and settled and self._admit()
            progressed |= self._compute_ready()
            self._forward_events()
            if len(self.checks) >= _DRAIN_BATCHES:
                self._drain_checks()
            now = time.perf_counter()
            if now - last_progress >= PROGRESS_INTERVAL_S:
                last_progress = now
                self._drain_checks()
                self._report_progress()
            if not progressed and self.jobs:
                oldest = next(iter(self.jobs))
                self._handle(self.worker.wait([oldest], WAIT_TIMEOUT_S))
        self._forward_events()
        self._drain_checks()
        return time.perf_counter() - start

    def _report_progress(self) -> None:
        if self.progress is None:
            return
        looked = max(1, self.lookup_blocks)
        disk = self.tiers.get(Tier.DISK)
        from_disk = (f" ({100 * disk.hits / looked:.1f} % from disk), {self.demoted_blocks} demoted"
                     if disk is not None else "")
        print(f"replay: {self.requests} requests, {self.load_submitted} block loads "
              f"(target {self.c.blocks_to_load}), hit rate {100 * self.verified / looked:.1f} %{from_disk}, "
              f"{self.blocks_stored} stored, corrupted {self.corrupted}",
              file=self.progress, flush=True)

    def _job_id(self) -> int:
        self.next_job += 1
        return self.next_job

    # ------------------------------------------------------------------ admission and loads

    def _admitting(self) -> bool:
        """Whether no limit of the run (requests, block loads, time) was reached yet."""
        c = self.c
        return not (
            self.requests >= (c.requests or c.blocks_to_load)
            or (c.blocks_to_load and self.load_submitted >= c.blocks_to_load)
            or time.perf_counter() >= self.deadline
        )

    def _admit(self) -> bool:
        """Admit requests while device blocks and load slots last; submit their loads."""
        loading = len({id(j.request) for j in self.jobs.values() if isinstance(j, _LoadJob)})
        first = self.requests
        admitted: list[_Request] = []
        limit = 1 if self.c.settle else self.c.inflight_requests
        while loading + len(admitted) < limit and self._admitting():
            if self.next_request is None:
                self.next_request = self.workload.next_request()
            keys = self.next_request
            if len(keys) > len(self.free):
                break
            self.next_request = None
            self.requests += 1
            self.lookup_blocks += len(keys)
            hits = self.manager.lookup(keys)
            blocks = [self.free.pop() for _ in keys]
            request = _Request(self.requests, keys, blocks, hits)
            if hits:
                request.load_plan = self.manager.prepare_load(keys[:hits])
                admitted.append(request)
            else:
                self.ready.append(request)
            self.load_submitted += hits
        if not admitted:
            return self.requests > first
        # One batch of poison for every new load, queued before the loads (which wait for it).
        self.patterns.poison([b for r in admitted for b in r.device_blocks[: r.hits]])
        for request in admitted:
            plan = request.load_plan
            assert plan is not None
            by_tier: dict[Tier, list[int]] = {}
            for i, tier in enumerate(plan.tiers):
                by_tier.setdefault(tier, []).append(i)
            for tier, positions in by_tier.items():  # one job per tier: they come back separately
                job = self._job_id()
                source = [plan.blocks[i] for i in positions]
                target = [request.device_blocks[i] for i in positions]
                if tier is Tier.HOST:
                    self.worker.load(job, source, target, stream=self.compute)
                else:
                    self.worker.load_from_disk(job, source, target, stream=self.compute)
                self.jobs[job] = _LoadJob(request, tier, positions)
                request.loads_pending += 1
                loads = self.tiers[tier]
                loads.jobs += 1
                if loads.in_flight == 0:
                    loads.busy_since = time.perf_counter()
                loads.in_flight += 1
                self.load_jobs += 1
        return True

    # ------------------------------------------------------------------ completions

    def _handle(self, results: list[TransferResult]) -> bool:
        """Apply finished jobs: loads are verified (or become misses), stores complete in the manager,
        finished demotions complete and release their plan's store."""
        verify_blocks: list[int] = []
        verify_keys: list[bytes] = []
        for result in results:
            job = self.jobs.pop(result.job_id)
            if isinstance(job, _StoreJob):
                self._store_done(job, result)
                continue
            if isinstance(job, _DemoteJob):
                self._demote_done(job, result)
                continue
            request, plan = job.request, job.request.load_plan
            assert plan is not None and result.direction in (Direction.LOAD, Direction.LOAD_FROM_DISK)
            keys = [request.keys[i] for i in job.positions]
            # A failed disk load drops that disk copy in the manager (the tier dropped the record).
            self.manager.complete_load(plan, keys, ok=result.ok)
            tier = self.tiers[job.tier]
            tier.in_flight -= 1
            if job.tier is Tier.HOST:
                tier.busy_s += result.seconds
            elif tier.in_flight == 0:
                tier.busy_s += time.perf_counter() - tier.busy_since
            if result.ok:
                self.blocks_loaded += len(keys)
                self.bytes_loaded += result.nbytes
                tier.hits += len(keys)
                tier.bytes += result.nbytes
                verify_blocks.extend(request.device_blocks[i] for i in job.positions)
                verify_keys.extend(keys)
            else:
                self.failed_loads += 1
                self.failed_load_blocks += len(keys)
                tier.failed_jobs += 1
                tier.failed_blocks += len(keys)
                request.failed.extend(job.positions)  # misses: recomputed below, never verified
            request.loads_pending -= 1
            if request.loads_pending == 0:
                self.ready.append(request)
        if verify_blocks:
            # Runs on the compute stream after the loads completed: the prefill's read of the prefix.
            flags = self.patterns.mismatches(verify_blocks, verify_keys)
            self.checks.append((verify_blocks, tuple(verify_keys), flags))
            self.verified += len(verify_blocks)
        return bool(results)

    def _store_done(self, job: _StoreJob, result: TransferResult) -> None:
        self.manager.complete_store(job.plan, result.ok)
        self.store_busy_s += result.seconds
        if result.ok:
            self.blocks_stored += len(job.plan.keys)
            self.bytes_stored += result.nbytes
        else:
            self.failed_stores += 1
            self.store_failed_blocks += len(job.plan.keys)
        self.free.extend(job.device_blocks)  # the store no longer reads them: safe to overwrite

    def _demote_done(self, job: _DemoteJob, result: TransferResult) -> None:
        plan = job.store.plan
        self.manager.complete_demote(plan, result.ok)  # failed: the disk copy is dropped, never loadable
        self.demote_busy_s += result.seconds
        if result.ok:
            self.demoted_blocks += len(plan.demotions)
            self.bytes_demoted += result.nbytes
            self.disk_io = result.path
        else:
            self.failed_demotes += 1
            self.demote_failed_blocks += len(plan.demotions)
        self._submit_store(job.store)  # its result came back: nothing reads those host blocks now

    # ------------------------------------------------------------------ compute and stores

    def _compute_ready(self) -> bool:
        """Compute every ready request's missing blocks in one batch, then submit their stores."""
        if not self.ready:
            return False
        batch, self.ready = self.ready, []
        blocks: list[int] = []
        keys: list[bytes] = []
        for request in batch:
            positions = request.computed_positions()
            blocks.extend(request.device_blocks[i] for i in positions)
            keys.extend(request.keys[i] for i in positions)
        if blocks:
            self.compute_batches += 1
            self.overlapped_batches += bool(self.jobs)
            if self.c.stall_cycles_per_block:
                torch.cuda._sleep(self.c.stall_cycles_per_block * len(blocks))  # type: ignore[no-untyped-call]
            self.patterns.write(blocks, keys)
            self.computed += len(blocks)
        for request in batch:
            self._store(request)
        return True

    def _store(self, request: _Request) -> None:
        """Offload the request's computed blocks (demotions first); free every device block no store
        reads."""
        computed = [request.keys[i] for i in request.computed_positions()]
        plan = self.manager.prepare_store(computed) if computed else None
        if computed and plan is None:
            self.stores_skipped += len(computed)
        if plan is None or not (plan.keys or plan.demotions):
            self.free.extend(request.device_blocks)
            return
        index = {key: i for i, key in enumerate(request.keys)}
        stored = [request.device_blocks[index[key]] for key in plan.keys]
        kept = set(stored)
        store = _StoreJob(plan, stored)
        if plan.demotions:
            self._demote_then_store(store)
        else:
            self._submit_store(store)
        self.free.extend(b for b in request.device_blocks if b not in kept)

    def _demote_then_store(self, store: _StoreJob) -> None:
        """Submit the plan's demotions; its store follows in :meth:`_demote_done` (it overwrites the
        host blocks the demotions read, so it may start only once their result came back)."""
        demotions = store.plan.demotions
        job = self._job_id()
        self.worker.demote(job, [d.host_block for d in demotions], [d.disk_block for d in demotions])
        self.jobs[job] = _DemoteJob(store)
        self.demote_jobs += 1

    def _submit_store(self, store: _StoreJob) -> None:
        if not store.plan.keys:
            return
        job = self._job_id()
        self.worker.store(job, store.device_blocks, store.plan.host_blocks, stream=self.compute)
        self.jobs[job] = store
        self.store_jobs += 1

    def _forward_events(self) -> None:
        for event in self.manager.events():
            self.events[event.kind.value] += 1

    # ------------------------------------------------------------------ verification results

    def _drain_checks(self) -> None:
        """Read the queued verification results back (syncs the compute stream up to them)."""
        if not self.checks:
            return
        checks, self.checks = self.checks, []
        flags = torch.cat([f for _, _, f in checks]).cpu().tolist()
        at = 0
        for blocks, keys, _ in checks:
            for block, key in zip(blocks, keys):
                if flags[at]:
                    self.corrupted += 1
                    if len(self.examples) < _MAX_EXAMPLES:
                        self.examples.append(f"key {key.hex()} in device block {block}")
                at += 1

    def abort(self, error: BaseException) -> None:
        """Record why the run stopped early; in-flight loads will never be verified."""
        self.errors.append(f"{type(error).__name__}: {error}")
        self._drain_checks()


def _unverified(replay: _Replay) -> int:
    """Blocks submitted for loading that were neither verified nor reported as a failed load."""
    return replay.load_submitted - replay.verified - replay.failed_load_blocks


def run_replay(config: ReplayConfig, progress: TextIO | None = None) -> ReplayReport:
    """Run the replay described by ``config``; progress lines go to ``progress`` (None: silent).

    Raises:
        InvalidArgumentError: a bad configuration (see :meth:`ReplayConfig.check`), or ``backend``
            "cuda" without a CUDA device.
        DiskError: the disk tier could not be created (e.g. ``disk_path`` exists and is not a
            kvoffload tier file, the file system refuses O_DIRECT with ``disk_direct="on"``, no room).
    """
    config.check()
    use_cuda = config.backend == "cuda" or (config.backend == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise InvalidArgumentError("backend = 'cuda' but torch sees no CUDA device")
    if not use_cuda and config.path != "auto":
        raise InvalidArgumentError(f"path = {config.path!r} applies to the cuda backend only")
    if not use_cuda and config.stall_cycles_per_block:
        raise InvalidArgumentError("stall_cycles_per_block applies to the cuda backend only")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    tensors, block_dim = build_cache(
        config.layout, num_blocks=config.device_blocks, layers=config.layers, kv_heads=config.kv_heads,
        head_dim=config.head_dim, block_size=config.block_size, dtype=DTYPES[config.dtype],
        device=device, fill=False,  # the replay writes every block before it reads it
    )
    layout = DeviceLayout.from_tensors(tensors, block_dim=block_dim)
    disk = (None if config.disk_path is None else
            DiskConfig(config.disk_path, config.disk_blocks, direct=DISK_DIRECT[config.disk_direct]))
    manager = Manager.create(config.host_blocks, fingerprint=layout.fingerprint, policy=config.policy,
                             num_disk_blocks=config.disk_blocks if disk is not None else 0)
    if progress is not None:
        disk_pool = (f", disk pool {config.disk_blocks} blocks "
                     f"({config.disk_blocks * layout.record_bytes / _GB:.2f} GB) in {config.disk_path}"
                     if disk is not None else "")
        print(f"replay: {config.layout} cache of {config.device_blocks} blocks on {device}, "
              f"{layout.block_bytes} bytes a block, host pool {config.host_blocks} blocks "
              f"({config.host_blocks * layout.record_bytes / _GB:.2f} GB){disk_pool}, "
              f"policy {config.policy}", file=progress, flush=True)
    compute = new_stream(device) if use_cuda else None
    wall = 0.0
    worker = Worker.create(layout, config.host_blocks, backend="cuda" if use_cuda else "host",
                           path=config.path, disk=disk)
    shutdown_errors: list[str] = []
    try:
        replay = _Replay(config, layout, manager, worker, compute, progress)
        path = worker.stats().path
        if use_cuda:
            torch.cuda.synchronize(device)  # the cache and pattern tables were made on the default stream
        with contextlib.ExitStack() as scope:
            if compute is not None:  # every kernel of the replay runs on the compute stream
                scope.enter_context(torch.cuda.stream(compute))
            try:
                wall = replay.run()
            except KVOffloadError as exc:  # a wait timeout, or a refused job (a replay bug)
                replay.abort(exc)
    finally:
        try:
            worker.shutdown()
        except KVOffloadError as exc:
            shutdown_errors.append(f"shutdown: {type(exc).__name__}: {exc}")
    replay.errors.extend(shutdown_errors)
    if use_cuda:
        torch.cuda.synchronize(device)
    return _report(config, replay, layout, device, path, wall, worker.disk_stats())


def _report(
    config: ReplayConfig, r: _Replay, layout: DeviceLayout, device: torch.device, path: str, wall: float,
    disk: DiskStats | None,
) -> ReplayReport:
    stats = r.manager.stats()
    hit_tokens = r.verified * config.block_size
    recompute_s = hit_tokens / config.prefill_tokens_per_s
    looked = max(1, r.lookup_blocks)
    tiers = {tier.value: loads for tier, loads in r.tiers.items()}
    load_busy_s = sum(t.busy_s for t in tiers.values())
    return ReplayReport(
        backend="cuda" if device.type == "cuda" else "host", path=path, policy=config.policy,
        device=str(device), record_bytes=layout.record_bytes, block_bytes=layout.block_bytes,
        block_tokens=config.block_size, device_blocks=config.device_blocks, host_blocks=config.host_blocks,
        requests=r.requests, continued_requests=r.workload.continued, lookup_blocks=r.lookup_blocks,
        hit_blocks=r.verified, hits_by_tier={name: t.hits for name, t in tiers.items()},
        hit_rate_by_tier={name: t.hits / looked for name, t in tiers.items()},
        load_jobs_by_tier={name: t.jobs for name, t in tiers.items()},
        failed_load_jobs_by_tier={name: t.failed_jobs for name, t in tiers.items()},
        failed_load_blocks_by_tier={name: t.failed_blocks for name, t in tiers.items()},
        bytes_loaded_by_tier={name: t.bytes for name, t in tiers.items()},
        load_gbps_by_tier={name: t.bytes / t.busy_s / _GB if t.busy_s > 0 else 0.0
                           for name, t in tiers.items()},
        hit_rate=r.verified / looked,
        manager_hit_rate=stats.hit_rate, computed_blocks=r.computed, failed_load_blocks=r.failed_load_blocks,
        load_jobs=r.load_jobs, store_jobs=r.store_jobs, blocks_loaded=r.blocks_loaded,
        blocks_stored=r.blocks_stored, store_failed_blocks=r.store_failed_blocks,
        stores_skipped_blocks=r.stores_skipped, host_evictions=stats.host_evictions,
        bytes_loaded=r.bytes_loaded, bytes_stored=r.bytes_stored,
        load_gbps=r.bytes_loaded / load_busy_s / _GB if load_busy_s > 0 else 0.0,
        store_gbps=r.bytes_stored / r.store_busy_s / _GB if r.store_busy_s > 0 else 0.0,
        load_wall_gbps=r.bytes_loaded / wall / _GB if wall > 0 else 0.0,
        store_wall_gbps=r.bytes_stored / wall / _GB if wall > 0 else 0.0,
        wall_s=wall, load_busy_s=load_busy_s, store_busy_s=r.store_busy_s,
        overlap_fraction=r.overlapped_batches / r.compute_batches if r.compute_batches else 0.0,
        prefill_tokens_per_s=config.prefill_tokens_per_s, hit_tokens=hit_tokens, recompute_s=recompute_s,
        prefill_saved_s=recompute_s - load_busy_s, verified_blocks=r.verified,
        corrupted_blocks=r.corrupted, unverified_blocks=_unverified(r), failed_load_jobs=r.failed_loads,
        failed_store_jobs=r.failed_stores,
        disk_path=config.disk_path or "", disk_blocks=config.disk_blocks if disk is not None else 0,
        disk_io=r.disk_io, disk_evictions=stats.disk_evictions, demote_jobs=r.demote_jobs,
        demoted_blocks=r.demoted_blocks, bytes_demoted=r.bytes_demoted, demote_busy_s=r.demote_busy_s,
        demote_failed_blocks=r.demote_failed_blocks, failed_demote_jobs=r.failed_demotes,
        disk_bytes_written=disk.bytes_written if disk is not None else 0,
        disk_bytes_read=disk.bytes_read if disk is not None else 0,
        disk_write_gbps=disk.write_gbps if disk is not None else 0.0,
        disk_read_gbps=disk.read_gbps if disk is not None else 0.0,
        disk_failures={name: int(getattr(disk, name)) for name in DISK_FAILURE_COUNTERS}
        if disk is not None else {},
        events=dict(r.events), target_blocks=config.blocks_to_load,
        target_reached=r.load_submitted >= config.blocks_to_load,
        corrupted_examples=tuple(r.examples), errors=tuple(r.errors),
    )


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replay's command-line options (defaults: the GPU's sizes with a GPU, small ones without)."""
    gpu = torch.cuda.is_available()
    d = ReplayConfig()
    parser.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    parser.add_argument("--path", choices=("auto", "dma", "staged", "sm"), default="auto",
                        help="transfer path of the cuda backend")
    geometry = parser.add_argument_group("KV cache geometry")
    geometry.add_argument("--layout", choices=LAYOUTS, default=d.layout)
    geometry.add_argument("--layers", type=int, default=d.layers)
    geometry.add_argument("--kv-heads", type=int, default=d.kv_heads)
    geometry.add_argument("--head-dim", type=int, default=d.head_dim)
    geometry.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    geometry.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype)
    geometry.add_argument("--device-blocks", type=int, default=8192 if gpu else d.device_blocks,
                          help=f"blocks in the device cache (default 8192 with a GPU, {d.device_blocks} without)")
    geometry.add_argument("--host-blocks", type=int, default=16384 if gpu else d.host_blocks,
                          help=f"records in the host pool (default 16384 with a GPU, {d.host_blocks} without)")
    geometry.add_argument("--policy", choices=sorted(POLICY_NAMES), default=d.policy,
                          help="host pool eviction policy")
    size = parser.add_argument_group("run length (the first limit reached ends admission)")
    size.add_argument("--requests", type=int, default=d.requests, help="requests to run (0: no limit)")
    size.add_argument("--blocks-to-load", type=int, default=100_000 if gpu else d.blocks_to_load,
                      help="stop admitting once this many block loads were submitted (0: no target; "
                           f"default 100000 with a GPU, {d.blocks_to_load} without)")
    size.add_argument("--max-seconds", type=float, default=d.max_seconds, help="time limit (0: none)")
    work = parser.add_argument_group("workload")
    work.add_argument("--documents", type=int, default=1000 if gpu else d.documents,
                      help="shared prefix documents")
    work.add_argument("--zipf", type=float, default=d.zipf, help="skew s of document popularity (0: uniform)")
    work.add_argument("--system-blocks", type=int, default=d.system_blocks,
                      help="system-prompt blocks shared by every request")
    work.add_argument("--doc-blocks-min", type=int, default=d.doc_blocks_min)
    work.add_argument("--doc-blocks-max", type=int, default=d.doc_blocks_max)
    work.add_argument("--suffix-blocks-min", type=int, default=d.suffix_blocks_min,
                      help="unique blocks a turn adds")
    work.add_argument("--suffix-blocks-max", type=int, default=d.suffix_blocks_max)
    work.add_argument("--continue-prob", type=float, default=d.continue_prob,
                      help="probability that a request continues an active conversation")
    work.add_argument("--max-conversations", type=int, default=d.max_conversations,
                      help="active conversations remembered (oldest dropped)")
    work.add_argument("--max-request-blocks", type=int, default=d.max_request_blocks,
                      help="longest request chain; a conversation that would exceed it ends")
    work.add_argument("--inflight-requests", type=int, default=d.inflight_requests,
                      help="requests waiting for their loads at once")
    work.add_argument("--settle", action="store_true",
                      help="one request at a time, each finished before the next: reproducible "
                           "hit rates (not representative throughput)")
    work.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s,
                      help="prefill rate of the simulated model, for the time-saved estimate")
    work.add_argument("--stall-cycles-per-block", type=int, default=d.stall_cycles_per_block,
                      help="cuda only: torch.cuda._sleep cycles per computed block, queued on the "
                           "compute stream before each compute batch (heavier compute)")
    tier = parser.add_argument_group("disk tier (below the host pool; none without --disk-path)")
    tier.add_argument("--disk-path", metavar="PATH", default=d.disk_path,
                      help="the tier file (its directory must exist); created, or recreated empty, and "
                           "left in place")
    tier.add_argument("--disk-blocks", type=int, default=d.disk_blocks,
                      help="records in the disk pool (required with --disk-path)")
    tier.add_argument("--disk-direct", choices=tuple(DISK_DIRECT), default=d.disk_direct,
                      help="O_DIRECT: on (or fail), off (buffered), auto (where the file system takes it)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    """The :class:`ReplayConfig` of parsed arguments (not checked yet)."""
    names = [f.name for f in attrs.fields(ReplayConfig)]
    return ReplayConfig(**{name: getattr(args, name) for name in names})


def print_report(report: ReplayReport, out: TextIO | None = None) -> None:
    """Print the replay's summary to ``out`` (stdout)."""
    out = sys.stdout if out is None else out
    looked = max(1, report.lookup_blocks)

    def row(name: str, value: str, note: str = "") -> None:
        print(f"  {name:<22} {value:>16}   {note}".rstrip(), file=out)

    print(f"kvoffload replay ({report.backend} backend, path {report.path}, policy {report.policy}, "
          f"{report.device})", file=out)
    row("requests", f"{report.requests}", f"{report.continued_requests} continued a conversation")
    row("blocks looked up", f"{report.lookup_blocks}",
        f"{report.block_tokens} tokens, {report.block_bytes} bytes a block")
    print(f"  {'tier':<22} {'hit blocks':>16}   hit rate   loads", file=out)
    for tier, count in report.hits_by_tier.items():
        print(f"  {'  ' + tier:<22} {count:>16}   {100 * count / looked:5.1f} %   "
              f"{report.load_jobs_by_tier[tier]} jobs, {report.bytes_loaded_by_tier[tier] / _GB:.3f} GB, "
              f"{report.load_gbps_by_tier[tier]:.2f} GB/s; failed {report.failed_load_jobs_by_tier[tier]} "
              f"jobs, {report.failed_load_blocks_by_tier[tier]} blocks", file=out)
    print(f"  {'  all tiers':<22} {report.hit_blocks:>16}   {100 * report.hit_rate:5.1f} %   "
          f"(manager lookups: {100 * report.manager_hit_rate:.1f} %)", file=out)
    row("failed loads", f"{report.failed_load_blocks} blocks", "recomputed as misses")
    row("computed", f"{report.computed_blocks} blocks", "misses written by the compute stream")
    row("block loads", f"{report.blocks_loaded}", f"{report.load_jobs} jobs")
    row("block stores", f"{report.blocks_stored}",
        f"{report.store_jobs} jobs; {report.stores_skipped_blocks} blocks not offloaded (pool busy)")
    row("host evictions", f"{report.host_evictions}")
    if report.disk_blocks:
        disk_failed = {name: n for name, n in report.disk_failures.items() if n}
        row("disk tier", f"{report.disk_blocks} blocks", f"{report.disk_path} ({report.disk_io or 'no I/O'})")
        row("demotions", f"{report.demoted_blocks} blocks",
            f"{report.demote_jobs} jobs, {report.bytes_demoted / _GB:.3f} GB; failed "
            f"{report.failed_demote_jobs} jobs, {report.demote_failed_blocks} blocks")
        row("disk evictions", f"{report.disk_evictions}")
        row("disk bytes", f"{(report.disk_bytes_written + report.disk_bytes_read) / _GB:.3f} GB",
            f"written {report.disk_bytes_written / _GB:.3f} at {report.disk_write_gbps:.2f} GB/s, read "
            f"{report.disk_bytes_read / _GB:.3f} at {report.disk_read_gbps:.2f} GB/s (the tier's counters)")
        row("disk failures", f"{sum(disk_failed.values())}",
            ", ".join(f"{name} {n}" for name, n in disk_failed.items()) or "none")
    row("bytes moved", f"{(report.bytes_loaded + report.bytes_stored) / _GB:.3f} GB",
        f"loaded {report.bytes_loaded / _GB:.3f}, stored {report.bytes_stored / _GB:.3f}")
    row("load", f"{report.load_gbps:7.2f} GB/s", f"copy time; {report.load_wall_gbps:.2f} GB/s over the run")
    row("store", f"{report.store_gbps:7.2f} GB/s", f"copy time; {report.store_wall_gbps:.2f} GB/s over the run")
    row("overlap", f"{100 * report.overlap_fraction:5.1f} %", "compute batches issued with copies in flight")
    row("prefill saved", f"{report.prefill_saved_s:.3f} s",
        f"{report.hit_tokens} hit tokens / {report.prefill_tokens_per_s:g} tok/s "
        f"- {report.load_busy_s:.3f} s of loads")
    row("wall", f"{report.wall_s:.2f} s")
    row("verified", f"{report.verified_blocks} blocks", "every loaded byte against its key's pattern")
    row("corrupted", f"{report.corrupted_blocks} blocks", f"unverified: {report.unverified_blocks}")
    row("failed jobs", f"{report.failed_load_jobs + report.failed_store_jobs + report.failed_demote_jobs}",
        f"{report.failed_load_jobs} load, {report.failed_store_jobs} store"
        + (f", {report.failed_demote_jobs} demote" if report.disk_blocks else ""))
    for example in report.corrupted_examples:
        row("  corrupted", example)
    if report.target_blocks and not report.target_reached:
        row("target", "NOT reached", f"{report.blocks_loaded} of {report.target_blocks} block loads")
    failures = report.failures()
    print("  result                 " + ("OK" if not failures else "FAILED: " + "; ".join(failures)),
          file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kvoffload replay``; returns the exit status (0: all verified)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload replay", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    try:
        config.check()
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    if not (args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())):
        print("kvoffload replay: no CUDA device in use - running the host backend (CPU tensors, copies "
              "by memmove on worker threads, compute in program order); figures are host memory speeds",
              flush=True)
    try:
        report = run_replay(config, progress=None if args.quiet else sys.stderr)
    except DiskError as exc:  # the tier file could not be created or opened: nothing ran
        print(f"kvoffload replay: the disk tier could not be created: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": attrs.asdict(config), "report": report.to_json()}, f, indent=2,
                      sort_keys=True)
            f.write("\n")
    return EXIT_OK if report.ok else EXIT_FAILED
