"""kvoffload as the host (and disk) tier of Hugging Face transformers' continuous batching.

Inside ``with offloading(model, num_host_blocks=...) as off:``, every continuous batching session of
``model`` (``model.generate_batch``, ``model.continuous_batching_context_manager``,
``model.init_continuous_batching``) keeps the complete blocks of its paged KV cache in a kvoffload
host pool, and loads them back when a prompt's prefix is no longer in the engine's cache::

    from kvoffload.integrations.transformers import offloading
    with offloading(model, num_host_blocks=8192) as off:
        out = model.generate_batch(inputs=prompts, generation_config=gc)
    print(off.stats())

What happens in a session (all of it in the engine's generation thread):

* **Stores** — when the engine registers a block as complete (its content hash is known), the
  block is stored at the start of the next scheduling step, in one job per step, ordered after the
  engine's compute stream. The scheduler does not wait for it: the engine's cache holds a
  reference to the block until the store completed, so that it is never evicted and rewritten
  while the store reads it. Keys are the engine's block hashes (blake2b, chained over the prefix,
  stable across processes), in a :class:`~kvoffload.Manager` bound to the model, its config, its
  dtype and the cache layout; the manager's policy decides which records stay on the host and, with
  a disk tier, which are demoted to disk (a demotion is written before the store that reuses its
  host record).
* **Loads** — just before the engine matches a pending request's prompt against its cache, the
  blocks after the resident prefix are looked up; the leading hits are loaded (host records, or disk
  records through pinned bounce buffers) into free engine blocks, ordered after the compute stream,
  and waited for; then they are registered in the engine's cache, so its prefix match shares them
  and prefill runs only on the rest. A load that fails (or does not finish within
  ``load_timeout``) registers nothing from the first failed block on: those tokens are recomputed.
* Room for a load is made by evicting cached engine blocks (every complete block is stored, so the
  host pool normally holds them), never the prompt's resident prefix. When the engine's cache is
  short while stores still hold blocks (a step in which nothing fit or active requests starved, or a
  load without room), those stores are waited for, so that the engine may evict the blocks; after a
  step in which nothing fit, the step is scheduled again. These are the only cases where the
  scheduler waits for a store.

Host records live as long as the engine's cache: one session (one ``generate_batch`` call, or a
persistent manager's life). A later session of the same model in the same ``offloading`` context
gets a fresh pool: the previous one is drained and released when the new session builds its
scheduler, so until then the previous session's worker keeps its engine cache tensor alive (on a
GPU, size later sessions with ``num_blocks`` or open one ``offloading`` context per session). Only
models whose layers are all full attention (the engine shares prefixes only there), on the CPU or
one CUDA device, without tensor parallelism, are supported; on CUDA the engine's synchronous
batching is the tested mode.

Requires transformers in :data:`SUPPORTED_TRANSFORMERS` (``pip install 'kvoffload[transformers]'``);
other versions are refused with :class:`UnsupportedEngineError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Protocol

import attrs
import torch

import kvoffload
from kvoffload import DiskConfig
from kvoffload.integrations import _transformers_surface as surface

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "OffloadStats",
    "Offloader",
    "UnsupportedEngineError",
    "WorkerFactory",
    "WorkerLike",
    "offloading",
]

_log = logging.getLogger("kvoffload.integrations.transformers")

SUPPORTED_TRANSFORMERS: Final = surface.SUPPORTED_RANGE
"""The transformers releases this integration supports (a pip version specifier)."""

DEFAULT_LOAD_TIMEOUT_S: Final = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 30.0
_KEY_BYTES: Final = 8  # the engine's block hashes are 64-bit
_POLICIES: Final = ("lru", "arc")


class UnsupportedEngineError(kvoffload.KVOffloadError, RuntimeError):
    """Raised when transformers is missing, outside :data:`SUPPORTED_TRANSFORMERS`, when the private
    names the integration relies on moved, or when the model is of a kind the integration does not
    support (sliding-window layers, tensor parallelism, a device other than the CPU or CUDA). The
    message names what was found and what is supported."""


class WorkerLike(Protocol):
    """The part of :class:`kvoffload.Worker` the integration uses (a test may wrap a real worker)."""

    def store(self, job_id: int, device_blocks: Sequence[int], host_blocks: Sequence[int], *,
              stream: object = None) -> None: ...

    def load(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
             stream: object = None) -> None: ...

    def load_from_disk(self, job_id: int, disk_blocks: Sequence[int], device_blocks: Sequence[int], *,
                       stream: object = None) -> None: ...

    def demote(self, job_id: int, host_blocks: Sequence[int], disk_blocks: Sequence[int]) -> None: ...

    def poll(self) -> list[kvoffload.TransferResult]: ...

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[kvoffload.TransferResult]: ...

    def shutdown(self, timeout: float = ...) -> None: ...


WorkerFactory = Callable[["kvoffload.DeviceLayout", int, "DiskConfig | None"], WorkerLike]
"""Builds the worker of a session from the engine cache's layout, the host pool size and the disk
tier (the default is ``Worker.create(layout, num_host_blocks, disk=disk)``)."""


@attrs.frozen
class OffloadStats:
    """What the integration did, over every session of one ``offloading`` context (blocks are engine
    blocks of ``tokens_per_block`` tokens).

    Attributes:
        sessions: engine sessions that ran with kvoffload (each with its own host pool).
        sessions_without_prefix_sharing: sessions left alone because the engine did not share prefixes
            (``allow_block_sharing=False``).
        blocks_stored: blocks whose store completed (host records that became loadable).
        blocks_store_failed: blocks whose store job failed (never loadable).
        blocks_not_stored: complete blocks not stored because every host record was busy.
        blocks_loaded_host / blocks_loaded_disk: blocks loaded into the engine's cache and registered.
        blocks_load_failed: blocks of failed or late loads (recomputed instead).
        prompt_tokens_engine_cache: prompt tokens the engine found in its own cache.
        prompt_tokens_host / prompt_tokens_disk: prompt tokens served by loaded blocks.
        prompt_tokens_computed: prompt tokens that ran through the model (prefill chunks).
        engine_blocks_evicted: cached (unreferenced) engine blocks evicted to make room for loads.
        manager: the current (or last) session's :class:`~kvoffload.ManagerStats`, or None.

    Counts are as of the engine's last scheduling step: a job that finished after it is counted at
    the next step (an idle engine schedules no step).
    """

    sessions: int
    sessions_without_prefix_sharing: int
    blocks_stored: int
    blocks_store_failed: int
    blocks_not_stored: int
    blocks_loaded_host: int
    blocks_loaded_disk: int
    blocks_load_failed: int
    prompt_tokens_engine_cache: int
    prompt_tokens_host: int
    prompt_tokens_disk: int
    prompt_tokens_computed: int
    engine_blocks_evicted: int
    manager: kvoffload.ManagerStats | None


@attrs.define
class _Counters:
    sessions: int = 0
    sessions_without_prefix_sharing: int = 0
    blocks_stored: int = 0
    blocks_store_failed: int = 0
    blocks_not_stored: int = 0
    blocks_loaded_host: int = 0
    blocks_loaded_disk: int = 0
    blocks_load_failed: int = 0
    prompt_tokens_engine_cache: int = 0
    prompt_tokens_host: int = 0
    prompt_tokens_disk: int = 0
    prompt_tokens_computed: int = 0
    engine_blocks_evicted: int = 0


@attrs.define
class _Store:
    """A store plan in flight: its device blocks (held in the engine's cache) and their hashes."""

    plan: kvoffload.StorePlan
    device_blocks: list[int]
    hashes: list[int]


@attrs.define
class _Match:
    """What :meth:`_Session.before_prefix_match` did for one prompt."""

    resident_blocks: int
    registered: list[int] = attrs.Factory(list)  # device blocks held until the match is over
    tiers: list[kvoffload.Tier] = attrs.Factory(list)


def _key(block_hash: int) -> bytes:
    return block_hash.to_bytes(_KEY_BYTES, "little", signed=False)


class _Session:
    """One engine session's offload state: its cache adapter, manager and worker.

    Owns the worker (shut down by :meth:`close`) and the references it holds in the engine's cache
    for stores in flight (released in the generation thread: at the next step, or by
    :meth:`before_schedule` once closed). Borrows the cache. Every method but :meth:`close` and
    :meth:`manager_stats` runs in the engine's generation thread; all of them take the offloader's
    lock.
    """

    def __init__(self, owner: Offloader, cache: surface.EngineCache, manager: kvoffload.Manager,
                 worker: WorkerLike) -> None:
        self._owner = owner
        self._lock = owner._lock
        self._counts = owner._counts
        self._cache: surface.EngineCache | None = cache
        self._tokens_per_block = cache.tokens_per_block
        self._manager = manager
        self._worker: WorkerLike | None = worker
        self._jobs = itertools.count(1)
        self._new: list[tuple[int, int]] = []
        self._stores: dict[int, _Store] = {}
        self._demotions: dict[int, _Store] = {}
        self._late_loads: dict[int, tuple[kvoffload.LoadPlan, list[bytes], list[int]]] = {}
        self._held: set[int] = set()  # engine blocks held until their store completed
        self._closed = False

    # ------------------------------------------------------------------ generation thread

    @property
    def active(self) -> bool:
        """False once the session is closed: the scheduler then behaves as the engine's own."""
        return not self._closed

    def on_new_hash(self, block: int, block_hash: int) -> None:
        """The engine registered ``block`` as complete with ``block_hash``: store it next step."""
        if not self._closed:
            self._new.append((block, block_hash))

    def before_schedule(self) -> bool:
        """Collect finished jobs and store the blocks completed since the last step. Returns False
        once closed (after releasing the references stores in flight held at close)."""
        with self._lock:
            cache = self._cache
            if self._closed:  # the worker is shut down: no copy touches these blocks any more
                if cache is not None:
                    for block in self._held:
                        cache.release(block)
                    for _, _, blocks in self._late_loads.values():
                        cache.return_blocks(blocks)
                    self._held.clear()
                    self._late_loads.clear()
                    self._cache = None
                return False
            assert self._worker is not None and cache is not None
            self._collect(self._worker.poll())
            self._store_new(cache, self._worker)
            return True

    def before_prefix_match(self, prompt: Sequence[int]) -> object:
        """Load the host and disk hits that follow the prompt's resident prefix into free engine
        blocks and register them, so that the engine's prefix match shares them."""
        with self._lock:
            if self._closed or self._cache is None or self._worker is None:
                return None
            cache, worker = self._cache, self._worker
            hashes = cache.block_hashes(prompt)
            resident = cache.resident_prefix(hashes)
            match = _Match(len(resident))
            wanted = [_key(h) for h in hashes[len(resident):]]
            hits = self._manager.lookup(wanted) if wanted else 0
            if hits == 0:
                return match
            room = self._make_room(cache, worker, hits + 1, resident)  # a block for the prompt's rest
            count = min(hits, room - 1)
            if count <= 0:
                return match
            plan = self._manager.prepare_load(wanted[:count])
            blocks = cache.take_blocks(count)
            ok = self._load(worker, plan, blocks)
            if ok is None:  # late: the blocks stay out of the pool until the jobs finished
                return match
            good = next((i for i, fine in enumerate(ok) if not fine), count)
            registered = cache.register_held(blocks[:good], hashes[len(resident):len(resident) + good])
            cache.return_blocks(blocks[registered:])
            match.registered = blocks[:registered]
            match.tiers = list(plan.tiers[:registered])
            failed = [k for k, fine in zip(plan.keys, ok) if not fine]
            if failed:
                self._manager.complete_load(plan, [k for k, fine in zip(plan.keys, ok) if fine])
                self._manager.complete_load(plan, failed, ok=False)
                self._counts.blocks_load_failed += len(failed)
                _log.warning("%d of %d loaded blocks failed; their tokens are recomputed",
                             len(failed), count)
            else:
                self._manager.complete_load(plan)
            for tier in match.tiers:
                if tier is kvoffload.Tier.HOST:
                    self._counts.blocks_loaded_host += 1
                else:
                    self._counts.blocks_loaded_disk += 1
            return match

    def after_prefix_match(self, token: object, matched_tokens: int) -> None:
        """Drop the references of :meth:`before_prefix_match` (the request now holds the blocks it
        matched) and count where the matched tokens came from."""
        with self._lock:
            if not isinstance(token, _Match):
                return
            size = self._tokens_per_block
            if self._cache is not None:
                for block in token.registered:
                    self._cache.release(block)
            matched_blocks = matched_tokens // size
            engine = min(matched_blocks, token.resident_blocks)
            self._counts.prompt_tokens_engine_cache += engine * size
            for tier in token.tiers[:max(0, matched_blocks - engine)]:
                if tier is kvoffload.Tier.HOST:
                    self._counts.prompt_tokens_host += size
                else:
                    self._counts.prompt_tokens_disk += size

    def after_schedule(self, chunks: list[surface.ScheduledChunk] | None, starved: bool) -> bool:
        """Count the prompt tokens of the step. When the cache was short (nothing fit, or active
        requests starved) while stores hold blocks, wait for those stores so that the engine may
        evict their blocks; after nothing fit, ask for another attempt."""
        with self._lock:
            if chunks is not None:
                self._counts.prompt_tokens_computed += sum(c.tokens for c in chunks if c.prompt)
            if not (chunks is None or starved):
                return False
            if self._closed or self._worker is None or not (self._stores or self._demotions):
                return False
            try:
                self._drain(self._worker, self._owner.load_timeout)
            except kvoffload.WaitTimeoutError as exc:
                _log.warning("stores still hold engine blocks after %.1f s: %s",
                             self._owner.load_timeout, exc)
                return False
            return chunks is None

    # ------------------------------------------------------------------ internals (lock held)

    def _stream(self) -> object:
        return self._owner._compute_stream

    def _store_new(self, cache: surface.EngineCache, worker: WorkerLike) -> None:
        new, self._new = self._new, []
        blocks: dict[bytes, tuple[int, int]] = {}
        for block, block_hash in new:
            if cache.hash_of(block) == block_hash:  # still the complete block it was registered as
                blocks.setdefault(_key(block_hash), (block, block_hash))
        if not blocks:
            return
        keys = list(blocks)
        count = len(keys)
        plan = self._manager.prepare_store(keys)
        if plan is None:  # the step's leading blocks, as many as the pool takes now
            count = min(count, self._manager.num_host_blocks)
            while plan is None and count > 0:
                plan = self._manager.prepare_store(keys[:count])
                count = count if plan is not None else count // 2
        self._counts.blocks_not_stored += len(keys) - count
        if plan is None:
            return
        if not plan.keys:
            return
        store = _Store(plan, [blocks[k][0] for k in plan.keys], [blocks[k][1] for k in plan.keys])
        for block in store.device_blocks:
            cache.hold(block)
        self._held.update(store.device_blocks)
        if plan.demotions:
            job = next(self._jobs)
            worker.demote(job, [d.host_block for d in plan.demotions], [d.disk_block for d in plan.demotions])
            self._demotions[job] = store
        else:
            self._submit_store(worker, store)

    def _make_room(self, cache: surface.EngineCache, worker: WorkerLike, wanted: int,
                   resident: list[int]) -> int:
        """Free engine blocks for a load of ``wanted - 1`` blocks: evict cached blocks (never the
        prompt's ``resident`` prefix), and if that is not enough, wait for the stores that hold
        blocks and evict again. Returns the blocks available."""
        room = cache.available_blocks()
        for attempt in range(2):
            if room >= wanted:
                break
            evicted = cache.evict_cached(wanted - room, keep=resident)
            self._counts.engine_blocks_evicted += evicted
            room += evicted
            if room >= wanted or attempt or not (self._stores or self._demotions):
                break
            try:
                self._drain(worker, self._owner.load_timeout)
            except kvoffload.WaitTimeoutError as exc:
                _log.warning("stores still hold engine blocks after %.1f s: %s", self._owner.load_timeout, exc)
                break
        return room

    def _submit_store(self, worker: WorkerLike, store: _Store) -> None:
        job = next(self._jobs)
        worker.store(job, store.device_blocks, store.plan.host_blocks, stream=self._stream())
        self._stores[job] = store

    def _load(self, worker: WorkerLike, plan: kvoffload.LoadPlan, blocks: list[int]) -> list[bool] | None:
        """Load ``plan`` into ``blocks`` and wait; per block, whether its job succeeded (None: a job
        did not finish in time; it completes later through :meth:`_collect`)."""
        jobs: list[tuple[int, list[int]]] = []
        for tier in (kvoffload.Tier.HOST, kvoffload.Tier.DISK):
            rows = [i for i, t in enumerate(plan.tiers) if t is tier]
            if not rows:
                continue
            job = next(self._jobs)
            src = [plan.blocks[i] for i in rows]
            dst = [blocks[i] for i in rows]
            if tier is kvoffload.Tier.HOST:
                worker.load(job, src, dst, stream=self._stream())
            else:
                worker.load_from_disk(job, src, dst, stream=self._stream())
            jobs.append((job, rows))
        try:
            results = worker.wait([job for job, _ in jobs], timeout=self._owner.load_timeout)
        except kvoffload.WaitTimeoutError as exc:
            _log.warning("loads did not finish within %.1f s; their tokens are recomputed: %s",
                         self._owner.load_timeout, exc)
            for job, rows in jobs:
                self._late_loads[job] = (plan, [plan.keys[i] for i in rows], [blocks[i] for i in rows])
            return None
        ok = [False] * len(blocks)
        for (_, rows), result in zip(jobs, results):
            for i in rows:
                ok[i] = result.ok
        return ok

    def _collect(self, results: Sequence[kvoffload.TransferResult]) -> None:
        assert self._cache is not None and self._worker is not None
        for result in results:
            store = self._stores.pop(result.job_id, None)
            if store is not None:
                self._finish_store(store, result.ok)
                continue
            demoted = self._demotions.pop(result.job_id, None)
            if demoted is not None:
                self._manager.complete_demote(demoted.plan, result.ok)
                self._submit_store(self._worker, demoted)
                continue
            late = self._late_loads.pop(result.job_id, None)
            if late is not None:
                plan, keys, blocks = late
                self._manager.complete_load(plan, keys, ok=False)
                self._counts.blocks_load_failed += len(keys)
                self._cache.return_blocks(blocks)
                continue
            _log.warning("a result for job %d that this session did not submit: %s", result.job_id, result)

    def _finish_store(self, store: _Store, ok: bool) -> None:
        assert self._cache is not None
        intact = [self._cache.hash_of(b) == h for b, h in zip(store.device_blocks, store.hashes)]
        if ok and not all(intact):  # the engine's ledger was reset under the store: bytes unknown
            ok = False
        self._manager.complete_store(store.plan, ok)
        if ok:
            self._counts.blocks_stored += len(store.device_blocks)
        else:
            self._counts.blocks_store_failed += len(store.device_blocks)
        for block, fine in zip(store.device_blocks, intact):
            self._held.discard(block)
            if fine:
                self._cache.release(block)

    def _drain(self, worker: WorkerLike, timeout: float) -> None:
        """Wait for every demotion and store (and the stores that follow the demotions)."""
        while self._demotions or self._stores:
            jobs = list(self._demotions) + list(self._stores)
            self._collect(worker.wait(jobs, timeout=timeout))

    # ------------------------------------------------------------------ user thread

    def close(self, timeout: float) -> None:
        """Stop the hooks and shut the worker down (draining its jobs); idempotent.

        The references held for stores stay until the generation thread's next step (if any)
        releases them; the engine's cache is no longer used from here.

        Raises:
            ShutdownError: from the worker's shutdown, after everything was released.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker, self._worker = self._worker, None
            cache = self._cache
        if cache is not None:
            cache.stop_intercepting()
        if worker is not None:
            worker.shutdown(timeout)

    def manager_stats(self) -> kvoffload.ManagerStats:
        """The session's manager statistics (lock held by the caller)."""
        return self._manager.stats()


class Offloader:
    """The handle ``offloading()`` yields: statistics, and the sessions it offloads.

    Owns the sessions' workers (through them the host pools) and the forward hook on the model;
    everything is released when the ``offloading`` context exits. Thread-safe.
    """

    def __init__(self, model: Any, num_host_blocks: int, disk: DiskConfig | None, policy: str,
                 make_worker: WorkerFactory, load_timeout: float, identity: str) -> None:
        self.model = model
        self.num_host_blocks = num_host_blocks
        self.disk = disk
        self.policy = policy
        self.load_timeout = load_timeout
        self._make_worker = make_worker
        self._identity = identity
        self._lock = threading.RLock()
        self._counts = _Counters()
        self._session: _Session | None = None
        self._last_manager: kvoffload.ManagerStats | None = None
        self._compute_stream: object = None
        self._closed = False

    def stats(self) -> OffloadStats:
        """A snapshot of :class:`OffloadStats`."""
        with self._lock:
            manager = self._session.manager_stats() if self._session is not None else self._last_manager
            return OffloadStats(manager=manager, **attrs.asdict(self._counts))

    def _bind(self, cache: surface.EngineCache) -> _Session | None:
        """Called when a session of the model builds its scheduler (generation thread)."""
        with self._lock:
            if self._closed:
                return None
            previous, self._session = self._session, None
        if previous is not None:
            self._retire(previous)
        if not cache.prefix_sharing:
            _log.warning("the engine does not share prefixes in this session (allow_block_sharing="
                         "False): kvoffload is not used")
            with self._lock:
                self._counts.sessions_without_prefix_sharing += 1
            return None
        layout = kvoffload.DeviceLayout.from_tensors({"kv_cache": cache.block_view()}, block_dim=0)
        manager = kvoffload.Manager.create(
            self.num_host_blocks,
            fingerprint=f"{self._identity}|tokens_per_block={cache.tokens_per_block}|{layout.fingerprint}",
            num_disk_blocks=self.disk.num_blocks if self.disk is not None else 0,
            policy=self.policy,
        )
        worker = self._make_worker(layout, self.num_host_blocks, self.disk)
        session = _Session(self, cache, manager, worker)
        cache.intercept_new_hashes(session.on_new_hash)
        with self._lock:
            self._session = session
            self._counts.sessions += 1
        return session

    def _retire(self, session: _Session) -> None:
        with self._lock:
            self._last_manager = session.manager_stats()
        session.close(DEFAULT_SHUTDOWN_TIMEOUT_S)

    def _close(self, timeout: float) -> None:
        with self._lock:
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            with self._lock:
                self._last_manager = session.manager_stats()
            session.close(timeout)


def _default_worker(layout: kvoffload.DeviceLayout, num_host_blocks: int,
                    disk: DiskConfig | None) -> WorkerLike:
    return kvoffload.Worker.create(layout, num_host_blocks, disk=disk)


def _check_engine() -> None:
    version = surface.installed_version()
    if version is None:
        raise UnsupportedEngineError(
            f"transformers is not installed; this integration needs transformers{SUPPORTED_TRANSFORMERS}: "
            "pip install 'kvoffload[transformers]'"
        )
    if not surface.version_supported(version):
        raise UnsupportedEngineError(
            f"transformers {version} is installed; this integration supports transformers"
            f"{SUPPORTED_TRANSFORMERS} only (pip install 'kvoffload[transformers]')"
        )
    try:
        surface.check_surface()
    except surface.SurfaceError as exc:
        raise UnsupportedEngineError(
            f"transformers {version}: the continuous batching internals this integration hooks moved: {exc}"
        ) from exc


def _identity(model: Any) -> str:
    """Names the model for the manager's fingerprint: class, config digest and dtype."""
    config_json = model.config.to_json_string(use_diff=False)
    digest = hashlib.blake2b(config_json.encode("utf-8"), digest_size=16).hexdigest()
    return f"transformers-cb|{type(model).__name__}|config={digest}|dtype={model.dtype}"


def _check_model(model: object) -> Any:
    generate_batch = getattr(model, "generate_batch", None)
    config = getattr(model, "config", None)
    if not callable(generate_batch) or config is None or not isinstance(model, torch.nn.Module):
        raise kvoffload.ArgumentTypeError(
            f"model = {type(model).__name__} is not a transformers model with continuous batching "
            "(a torch.nn.Module with .config and .generate_batch)"
        )
    device = torch.device(getattr(model, "device", "cpu"))
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedEngineError(f"model.device = {device}: only the CPU and CUDA devices are supported")
    if getattr(model, "_device_mesh", None) is not None:
        raise UnsupportedEngineError("the model is tensor parallel (model._device_mesh is set): not supported")
    text_config = config.get_text_config()
    try:
        groups = surface.attention_groups(text_config)
    except surface.SurfaceError as exc:
        raise UnsupportedEngineError(str(exc)) from exc
    if list(groups) != [surface.FULL_ATTENTION]:
        raise UnsupportedEngineError(
            f"the model's attention groups are {sorted(groups)}: the engine shares prefix blocks only when "
            f"every layer is {surface.FULL_ATTENTION!r}, so there is nothing to offload"
        )
    return text_config


def _check_args(num_host_blocks: object, disk: object, load_timeout: object, shutdown_timeout: object,
                make_worker: object) -> None:
    if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int):
        raise kvoffload.ArgumentTypeError(
            f"num_host_blocks = {num_host_blocks!r} is a {type(num_host_blocks).__name__}; it must be an int"
        )
    if num_host_blocks < 1:
        raise kvoffload.InvalidArgumentError(f"num_host_blocks = {num_host_blocks} must be >= 1")
    if disk is not None:
        if not isinstance(disk, DiskConfig):
            raise kvoffload.ArgumentTypeError(f"disk = {disk!r} must be a DiskConfig or None")
    for name, value in (("load_timeout", load_timeout), ("shutdown_timeout", shutdown_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise kvoffload.InvalidArgumentError(f"{name} = {value!r} must be a number of seconds > 0")
    if make_worker is not None and not callable(make_worker):
        raise kvoffload.ArgumentTypeError(f"make_worker = {make_worker!r} must be callable or None")


@contextlib.contextmanager
def offloading(
    model: Any,
    num_host_blocks: int,
    disk: DiskConfig | None = None,
    *,
    policy: str = "lru",
    make_worker: WorkerFactory | None = None,
    load_timeout: float = DEFAULT_LOAD_TIMEOUT_S,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> Iterator[Offloader]:
    """Offload the KV cache of ``model``'s continuous batching sessions through kvoffload while the
    context is open (see the module docstring for what happens in a session).

    Args:
        model: a transformers model with continuous batching (``generate_batch``), whose layers are
            all full attention, on the CPU or one CUDA device.
        num_host_blocks: host records in each session's pool; one record holds one engine block (every
            layer's K and V of ``page_size`` tokens).
        disk: a disk tier below the host pool (``kvoffload.DiskConfig``), or None.
        policy: the manager's eviction policy (``"lru"``, ``"arc"``).
        make_worker: builds each session's worker (default ``Worker.create(layout, num_host_blocks,
            disk=disk)``); the integration owns what it returns and shuts it down.
        load_timeout: seconds a scheduling step waits for a load (or, when the cache is full, for the
            stores in flight) before giving up on it: its tokens are then recomputed.
        shutdown_timeout: seconds the exit gives each worker's shutdown.

    Yields the :class:`Offloader` (``stats()``). On exit the model's sessions are built with the
    engine's own scheduler again, the hook on the model is removed and every worker is shut down.
    A session still running then continues without kvoffload.

    Raises (before anything is hooked):
        UnsupportedEngineError: transformers missing or not in :data:`SUPPORTED_TRANSFORMERS`, its
            internals moved, or an unsupported model (see the class).
        ArgumentTypeError, InvalidArgumentError: a bad argument (named in the message), or the model
            is inside another ``offloading`` context already.
        ShutdownError: on exit, from a worker's shutdown (after everything else was released).
    """
    _check_engine()
    text_config = _check_model(model)
    _check_args(num_host_blocks, disk, load_timeout, shutdown_timeout, make_worker)
    if policy not in _POLICIES:
        raise kvoffload.UnknownPolicyError(f"policy = {policy!r} is not one of {list(_POLICIES)}")
    offloader = Offloader(model, num_host_blocks, disk, policy, make_worker or _default_worker,
                          float(load_timeout), _identity(model))
    try:
        surface.register_model(text_config, offloader._bind)
    except surface.SurfaceError as exc:
        raise kvoffload.InvalidArgumentError(
            f"model = {type(model).__name__} is inside another offloading() context already"
        ) from exc
    handle = None
    device = torch.device(model.device)
    if device.type == "cuda":
        def record_compute_stream(module: torch.nn.Module, args: Any) -> None:
            offloader._compute_stream = torch.cuda.current_stream(device)

        handle = model.register_forward_pre_hook(record_compute_stream)
    try:
        yield offloader
    finally:
        surface.unregister_model(text_config)
        if handle is not None:
            handle.remove()
        offloader._close(float(shutdown_timeout))
