"""The transformers integration's session: one engine cache's stores and loads through a kvoffload
Worker and Manager (see :mod:`kvoffload.integrations.transformers` for what happens when), and the
records and protocols it shares with the public module.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs

import kvoffload
from kvoffload.integrations import _transformers_surface as surface

__all__ = [
    "LayerWaiter",
    "OffloadStats",
    "UnsupportedEngineError",
    "WorkerFactory",
    "WorkerLike",
]

_log = logging.getLogger("kvoffload.integrations.transformers")

_KEY_BYTES: Final = 8  # the engine's block hashes are 64-bit
#: How long past the exit's own deadline a step waits for the exit's shutdown to say whether copies
#: stopped (the shutdown returns within about its timeout; this covers the "about").
_SHUTDOWN_SLACK_S: Final = 1.0


class UnsupportedEngineError(kvoffload.KVOffloadError, RuntimeError):
    """Raised when transformers is missing, outside :data:`SUPPORTED_TRANSFORMERS`, when the private
    names the integration relies on moved, or when the model is of a kind the integration does not
    support (sliding-window layers, tensor parallelism, a device other than the CPU or CUDA). The
    message names what was found and what is supported."""


class LayerWaiter(Protocol):
    """The part of :class:`kvoffload.LayerLoad` the integration uses."""

    def wait_layer(self, layer: int, stream: object = None) -> None: ...


class WorkerLike(Protocol):
    """The part of :class:`kvoffload.Worker` the integration uses (a test may wrap a real worker)."""

    def store(self, job_id: int, device_blocks: Sequence[int], host_blocks: Sequence[int], *,
              stream: object = None) -> None: ...

    def load(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
             stream: object = None) -> None: ...

    def load_by_layer(self, job_id: int, host_blocks: Sequence[int], device_blocks: Sequence[int], *,
                      stream: object = None) -> LayerWaiter: ...

    def load_from_disk(self, job_id: int, disk_blocks: Sequence[int], device_blocks: Sequence[int], *,
                       stream: object = None, keys: Sequence[bytes] | None = None) -> None: ...

    def demote(self, job_id: int, host_blocks: Sequence[int], disk_blocks: Sequence[int], *,
               keys: Sequence[bytes] | None = None) -> None: ...

    def disk_valid_blocks(self) -> Mapping[int, kvoffload.DiskRecord]: ...

    def poll(self) -> list[kvoffload.TransferResult]: ...

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[kvoffload.TransferResult]: ...

    def shutdown(self, timeout: float = ...) -> None: ...


WorkerFactory = Callable[["kvoffload.DeviceLayout", int, "kvoffload.DiskConfig | None"], WorkerLike]
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
        sessions_without_worker: sessions left alone because their worker could not be made (a
            :class:`~kvoffload.KVOffloadError` from ``make_worker``, logged at error level: too
            little host memory for the pool, a calibration without a correct path, ...): the engine
            ran them as it does without kvoffload.
        blocks_stored: blocks whose store completed (host records that became loadable).
        blocks_store_failed: blocks whose store job failed (never loadable).
        blocks_not_stored: complete blocks not stored because every host record was busy.
        blocks_loaded_host / blocks_loaded_disk: blocks loaded into the engine's cache and registered.
        blocks_adopted_disk: disk records a session took over when it opened a tier file warm
            (``DiskConfig(reuse=True)``): the blocks an earlier session or process demoted there,
            under the same model, cache geometry and layout.
        blocks_load_failed: blocks of failed or late loads (recomputed instead; a layer-by-layer load
            that fails after the engine read its blocks fails the engine's step instead).
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
    sessions_without_worker: int
    blocks_stored: int
    blocks_store_failed: int
    blocks_not_stored: int
    blocks_loaded_host: int
    blocks_loaded_disk: int
    blocks_adopted_disk: int
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
    sessions_without_worker: int = 0
    blocks_stored: int = 0
    blocks_store_failed: int = 0
    blocks_not_stored: int = 0
    blocks_loaded_host: int = 0
    blocks_loaded_disk: int = 0
    blocks_adopted_disk: int = 0
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
    layered: _Layered | None = None  # its layer-by-layer load, and that load's rows of the match
    layered_rows: set[int] = attrs.Factory(set)


@attrs.define
class _Layered:
    """A layer-by-layer host load whose blocks the engine may already read (every attention layer
    waits for its layer on the device). Until its result was collected, the session holds a
    reference to each of its ``registered`` blocks and keeps its ``unregistered`` ones out of the
    engine's pool, so that no block it writes is evicted and rewritten meanwhile."""

    load: LayerWaiter | None  # None until submitted (see _Session.flush_loads)
    plan: kvoffload.LoadPlan
    keys: list[bytes]
    host_blocks: list[int]
    device_blocks: list[int]
    registered: list[int] = attrs.Factory(list)
    unregistered: list[int] = attrs.Factory(list)
    prompt_tokens_host: int = 0  # the prompt tokens counted as served by it (taken back if it fails)
    dropped: bool = False

    def submit(self, worker: WorkerLike, job: int, stream: object) -> None:
        """Submit the load (layer by layer, after the work queued on ``stream``).

        Raises: as ``load_by_layer`` (nothing is submitted then).
        """
        self.load = worker.load_by_layer(job, self.host_blocks, self.device_blocks, stream=stream)


def _key(block_hash: int) -> bytes:
    return block_hash.to_bytes(_KEY_BYTES, "little", signed=False)


class _Owner(Protocol):
    """What a session borrows from its :class:`~kvoffload.integrations.transformers.Offloader`."""

    _lock: threading.RLock
    _counts: _Counters
    load_timeout: float
    _graphs_seen: bool  # the engine captured a CUDA graph of the model: its replays run no hooks

    @property
    def _compute_stream(self) -> Any: ...


class _Session:
    """One engine session's offload state: its cache adapter, manager and worker.

    Owns the worker (shut down by :meth:`close`) and the references it holds in the engine's cache
    for stores in flight (released in the generation thread: at the next step, or by
    :meth:`before_schedule` once closed). Borrows the cache. Every method but :meth:`close` and
    :meth:`manager_stats` runs in the engine's generation thread; all of them take the offloader's
    lock.
    """

    def __init__(self, owner: _Owner, cache: surface.EngineCache, manager: kvoffload.Manager,
                 worker: WorkerLike, layer_of: dict[int, int] | None, defer_loads: bool = False) -> None:
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
        self._layer_of = layer_of  # model layer -> the layout's layer; None: loads are waited for
        self._layered: dict[int, _Layered] = {}
        self._defer_loads = defer_loads  # submit layered loads when the next forward starts
        self._landed: set[int] = set()  # layered loads found landed by close
        self._unlanded: set[int] = set()  # layered loads close could not land: never read them
        self._closed = False
        # Set by fail_later_steps: the engine's steps fail from the next one on (see there).
        self._fail_steps = False
        # The worker's shutdown: None until it returned; True when every copy stopped; False when
        # copies may still write engine blocks (they are then never given back to the engine).
        self._stopped: bool | None = None
        self._stop_known = threading.Event()  # set with _stopped
        self._close_deadline = 0.0  # when the exit's shutdown returns at the latest

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
        once closed, after releasing the references stores in flight held at close, and giving
        back the blocks of late and layer-by-layer loads once the worker's shutdown proved their
        copies stopped (while the exit's shutdown runs, a step with such blocks waits for it: the
        engine may need them; a shutdown that could not prove it keeps them out for good)."""
        with self._lock:
            closing = self._closed and self._stopped is None and bool(self._late_loads or self._layered)
            deadline = self._close_deadline
        if closing:  # the exit's shutdown runs, and copies may still land in engine blocks: the step
            self._stop_known.wait(max(0.0, deadline - time.monotonic()))  # waits for it (bounded)
        with self._lock:
            cache = self._cache
            if self._closed:
                if cache is not None:
                    for block in self._held:  # stores only read them
                        cache.release(block)
                    self._held.clear()
                    if self._stopped is None:  # the worker's shutdown runs: copies may still land
                        return False
                    if self._stopped:  # every copy stopped: the blocks are the engine's again
                        for _, _, blocks in self._late_loads.values():
                            cache.return_blocks(blocks)
                        for layered in self._layered.values():
                            for block in layered.registered:
                                cache.release(block)
                            cache.return_blocks(layered.unregistered)
                    elif self._late_loads or self._layered:  # a copy may still write them: never again
                        _log.error("the worker's shutdown could not prove its copies stopped: %d engine "
                                   "block(s) they may write are kept out of the engine's pool",
                                   sum(len(b) for _, _, b in self._late_loads.values())
                                   + sum(len(layered.device_blocks) for layered in self._layered.values()))
                    self._late_loads.clear()
                    self._layered.clear()
                    self._cache = None
                if self._fail_steps:
                    raise kvoffload.TransferError(
                        f"{len(self._unlanded)} layer-by-layer load(s) of this engine's kvoffload session did not "
                        "land before a new session of the model replaced it: requests of this engine that "
                        "matched their blocks would read blocks the load may not have written, so its steps "
                        "fail (run requests on the new session's engine)"
                    )
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
            # Making room collects finished jobs (a late load's among them), which may drop copies
            # the lookup counted (a load that failed drops its disk copy): look again.
            hits = self._manager.lookup(wanted[:hits])
            count = min(hits, room - 1)
            if count <= 0:
                return match
            plan = self._manager.prepare_load(wanted[:count])
            blocks = cache.take_blocks(count)
            layered_job, layered_load, layered_rows = self._load_layered(worker, plan, blocks)
            ok = self._load(worker, plan, blocks, skip=set(layered_rows))
            if ok is None:  # late: the blocks stay out of the pool until the jobs finished
                rows_keys = [plan.keys[i] for i in layered_rows]
                rows_blocks = [blocks[i] for i in layered_rows]
                if layered_job is not None and layered_load is not None:  # completes in _collect
                    self._late_loads[layered_job] = (plan, rows_keys, rows_blocks)
                elif layered_rows:  # refused, or deferred and now never submitted: nothing copies
                    self._manager.complete_load(plan, rows_keys, ok=False)
                    self._counts.blocks_load_failed += len(rows_keys)
                    cache.return_blocks(rows_blocks)
                return match
            for i in layered_rows:
                ok[i] = layered_job is not None  # in flight, or refused at submit (recomputed)
            good = next((i for i, fine in enumerate(ok) if not fine), count)
            registered = cache.register_held(blocks[:good], hashes[len(resident):len(resident) + good])
            in_flight = set(layered_rows) if layered_job is not None else set()
            cache.return_blocks([b for i, b in enumerate(blocks[registered:], registered) if i not in in_flight])
            match.registered = [b for i, b in enumerate(blocks[:registered]) if i not in in_flight]
            match.tiers = list(plan.tiers[:registered])
            if layered_job is not None:
                match.layered = self._layered[layered_job] = _Layered(
                    layered_load, plan, [plan.keys[i] for i in layered_rows],
                    [plan.blocks[i] for i in layered_rows], [blocks[i] for i in layered_rows],
                    registered=[blocks[i] for i in layered_rows if i < registered],
                    unregistered=[blocks[i] for i in layered_rows if i >= registered],
                )
                match.layered_rows = in_flight  # (a set: looked up per matched row)
            waited = [i for i in range(count) if i not in in_flight]
            failed = [plan.keys[i] for i in waited if not ok[i]]
            if failed:
                self._manager.complete_load(plan, [plan.keys[i] for i in waited if ok[i]])
                self._manager.complete_load(plan, failed, ok=False)
                self._counts.blocks_load_failed += len(failed)
                _log.warning("%d of %d loaded blocks failed; their tokens are recomputed",
                             len(failed), count)
            elif not in_flight:
                self._manager.complete_load(plan)
            elif waited:
                self._manager.complete_load(plan, [plan.keys[i] for i in waited])
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
            counted = max(0, matched_blocks - engine)
            layered = token.layered
            for row, tier in enumerate(token.tiers[:counted]):
                if layered is not None and row in token.layered_rows:
                    if layered.dropped:  # failed already: served nothing
                        continue
                    layered.prompt_tokens_host += size
                if tier is kvoffload.Tier.HOST:
                    self._counts.prompt_tokens_host += size
                else:
                    self._counts.prompt_tokens_disk += size

    @property
    def layered_in_flight(self) -> bool:
        """Whether a layer-by-layer load is in flight (its result not collected yet); read without
        the lock (see ``Offloader._layered_in_flight``); also once close could not land one."""
        return bool(self._layered or self._unlanded)

    def before_layer(self, layer: int, stream: object) -> None:
        """Model layer ``layer``'s attention is about to run (in the forward, generation thread):
        order ``stream`` (None on the CPU) after that layer's pages of every layer-by-layer load in
        flight. On CUDA nothing waits on the host.

        Raises:
            KVOffloadError: from ``LayerLoad.wait_layer`` (the layer could not be ordered; the
                forward must not read it).
        """
        with self._lock:
            if self._layer_of is None:
                return
            index = self._layer_of.get(layer)
            if index is None:
                return
            if self._closed:  # close landed every load it could: a forward must not read the others
                if self._unlanded:
                    raise kvoffload.TransferError(
                        f"{len(self._unlanded)} layer-by-layer load(s) did not land before the offloading "
                        "context closed; the step fails instead of reading their blocks"
                    )
                return
            # a deferred one (load None) is submitted when the forward starts
            loads = [(job, layered.load) for job, layered in self._layered.items() if layered.load is not None]
        for _, load in loads:  # outside the lock: a wait on the CPU blocks, and close needs the lock
            load.wait_layer(index, stream)
        with self._lock:  # a close meanwhile may have given up a load (its marks settle unwritten)
            if self._given_up(job for job, _ in loads):
                raise kvoffload.TransferError(
                    "a layer-by-layer load did not land before the offloading context closed; the "
                    "step fails instead of reading its blocks"
                )

    def fail_later_steps(self) -> None:
        """A new session of the model replaced this one, whose close gave up a layer-by-layer load:
        every step of this session's engine from the next one on raises ``TransferError`` (in
        :meth:`before_schedule`, after what it releases), since a request that matched the load's
        blocks would read them and the layer hooks now ask the new session."""
        with self._lock:
            self._fail_steps = True

    @property
    def engine_cache(self) -> object:
        """The engine's ``PagedAttentionCache`` this session runs on (borrowed); None once closed."""
        cache = self._cache
        return cache.engine_cache if cache is not None else None

    @property
    def gave_up_loads(self) -> bool:
        """Whether close could not land a layer-by-layer load (the layer hooks then fail a step
        that would read one)."""
        return bool(self._unlanded)

    def _given_up(self, jobs: Iterable[int]) -> bool:
        """Whether close gave up landing one of the layered loads ``jobs`` (lock held)."""
        return self._closed and any(job in self._unlanded for job in jobs)

    def flush_loads(self, stream: object) -> None:
        """A forward is about to start (generation thread): submit the deferred layer-by-layer loads,
        ordered after ``stream``. Deferring them to here keeps their copies out of the way of the
        engine's own input copies of the step (a copy engine works in order; measured on an H200,
        a 512 MiB load submitted at the prefix match delayed the step's input copies by its whole
        length), and the copies then run under the forward's kernel launches.

        Raises:
            TransferError: a deferred load was refused; its blocks, registered already, are dropped
                from the engine's cache and the forward must not run.
        """
        with self._lock:
            if self._closed or self._worker is None:
                return
            self._flush(self._worker, stream)

    def _flush(self, worker: WorkerLike, stream: object) -> None:
        refused: list[tuple[int, BaseException]] = []
        for job, layered in list(self._layered.items()):
            if layered.load is not None:
                continue
            try:
                layered.submit(worker, job, stream)
            except kvoffload.KVOffloadError as exc:
                refused.append((job, exc))
                del self._layered[job]
                self._drop_layered(layered)
        if refused:
            raise kvoffload.TransferError(
                f"{len(refused)} deferred layer-by-layer load(s) were refused after their blocks were "
                f"registered (first: job {refused[0][0]}: {refused[0][1]}); the blocks are dropped and "
                "the step fails instead of reading them"
            )

    def _drop_layered(self, layered: _Layered) -> None:
        """A layered load that will not land (or did not): its blocks are never shared again."""
        assert self._cache is not None
        self._manager.complete_load(layered.plan, layered.keys, ok=False)
        self._counts.blocks_load_failed += len(layered.keys)
        self._counts.blocks_loaded_host -= len(layered.registered)
        self._counts.prompt_tokens_host -= layered.prompt_tokens_host  # nor its prompt tokens
        layered.prompt_tokens_host, layered.dropped = 0, True
        for block in layered.registered:
            self._cache.forget(block)
            self._cache.release(block)
        self._cache.return_blocks(layered.unregistered)

    def after_schedule(self, chunks: list[surface.ScheduledChunk] | None, starved: bool) -> bool:
        """Count the prompt tokens of the step. When the cache was short (nothing fit, or active
        requests starved) while stores hold blocks, wait for those stores so that the engine may
        evict their blocks; after nothing fit, ask for another attempt."""
        with self._lock:
            if chunks is not None:
                self._counts.prompt_tokens_computed += sum(c.tokens for c in chunks if c.prompt)
            if not (chunks is None or starved):
                return False
            if self._closed or self._worker is None or not self._holding():
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
            worker.demote(job, [d.host_block for d in plan.demotions], [d.disk_block for d in plan.demotions],
                          keys=[self._manager.namespaced(d.key) for d in plan.demotions])
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
            if room >= wanted or attempt or not self._holding():
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

    def _load_layered(self, worker: WorkerLike, plan: kvoffload.LoadPlan, blocks: list[int]
                      ) -> tuple[int | None, LayerWaiter | None, list[int]]:
        """Submit the plan's host rows as one layer-by-layer load (not waited for: every attention
        layer waits for its layer on the device, see :meth:`before_layer`), or, when loads are
        deferred, only number it. Returns the job and its handle (None while deferred; both None
        when the worker refused it: those blocks are recomputed) and the rows; no rows when loads
        are waited for whole."""
        if self._layer_of is None or self._owner._graphs_seen:  # a replayed forward would not wait
            return None, None, []
        rows = [i for i, t in enumerate(plan.tiers) if t is kvoffload.Tier.HOST]
        if not rows:
            return None, None, []
        job = next(self._jobs)
        if self._defer_loads:  # submitted by flush_loads, when the forward that reads them starts
            return job, None, rows
        try:
            load = worker.load_by_layer(job, [plan.blocks[i] for i in rows], [blocks[i] for i in rows],
                                        stream=self._stream())
        except kvoffload.KVOffloadError as exc:
            _log.warning("a layer-by-layer load of %d blocks was refused; their tokens are recomputed: %s",
                         len(rows), exc)
            return None, None, rows
        return job, load, rows

    def _load(self, worker: WorkerLike, plan: kvoffload.LoadPlan, blocks: list[int],
              skip: set[int]) -> list[bool] | None:
        """Load ``plan`` into ``blocks`` (but the rows in ``skip``) and wait; per block, whether its
        job succeeded (None: a job did not finish in time; it completes later through
        :meth:`_collect`)."""
        jobs: list[tuple[int, list[int]]] = []
        refused: list[int] = []
        for tier in (kvoffload.Tier.HOST, kvoffload.Tier.DISK):
            rows = [i for i, t in enumerate(plan.tiers) if t is tier and i not in skip]
            if not rows:
                continue
            job = next(self._jobs)
            src = [plan.blocks[i] for i in rows]
            dst = [blocks[i] for i in rows]
            try:
                if tier is kvoffload.Tier.HOST:
                    worker.load(job, src, dst, stream=self._stream())
                else:
                    worker.load_from_disk(job, src, dst, stream=self._stream(),
                                          keys=[self._manager.namespaced(plan.keys[i]) for i in rows])
            except kvoffload.KVOffloadError as exc:  # nothing copies: failed rows, recomputed
                _log.warning("a load of %d blocks was refused; their tokens are recomputed: %s", len(rows), exc)
                refused += rows
                continue
            jobs.append((job, rows))
        if not jobs:
            return [False] * len(blocks)
        try:
            results = worker.wait([job for job, _ in jobs], timeout=self._owner.load_timeout)
        except kvoffload.WaitTimeoutError as exc:
            _log.warning("loads did not finish within %.1f s; their tokens are recomputed: %s",
                         self._owner.load_timeout, exc)
            for job, rows in jobs:
                self._late_loads[job] = (plan, [plan.keys[i] for i in rows], [blocks[i] for i in rows])
            if refused:  # the late ones complete in _collect; these are done with now
                assert self._cache is not None
                self._manager.complete_load(plan, [plan.keys[i] for i in refused], ok=False)
                self._counts.blocks_load_failed += len(refused)
                self._cache.return_blocks([blocks[i] for i in refused])
            return None
        ok = [False] * len(blocks)
        for (_, rows), result in zip(jobs, results):
            for i in rows:
                ok[i] = result.ok
        return ok

    def _collect(self, results: Sequence[kvoffload.TransferResult]) -> None:
        """Complete the jobs of ``results``. Raises TransferError (after completing all of them)
        when a layer-by-layer load failed: the engine's step that read its blocks read undefined
        bytes, so the step must fail rather than emit tokens."""
        assert self._cache is not None and self._worker is not None
        failed_layered: list[kvoffload.TransferResult] = []
        for result in results:
            layered = self._layered.pop(result.job_id, None)
            if layered is not None:
                self._finish_layered(layered, result, failed_layered)
                continue
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
                plan, keys, blocks = late  # recomputed meanwhile: the blocks go back unregistered
                self._manager.complete_load(plan, keys, ok=result.ok)  # one that landed keeps its
                self._counts.blocks_load_failed += len(keys)  # disk copies (counted: late)
                self._cache.return_blocks(blocks)
                continue
            _log.warning("a result for job %d that this session did not submit: %s", result.job_id, result)
        if failed_layered:
            raise kvoffload.TransferError(
                f"{len(failed_layered)} layer-by-layer load job(s) failed after the engine's step read "
                f"their blocks (first: job {failed_layered[0].job_id}: {failed_layered[0].error}); the "
                "blocks are dropped and the step fails instead of emitting tokens from them"
            )

    def _finish_layered(self, layered: _Layered, result: kvoffload.TransferResult,
                        failed: list[kvoffload.TransferResult]) -> None:
        assert self._cache is not None
        if not result.ok:  # its blocks' bytes are undefined: never shared again
            failed.append(result)
            _log.error("a layer-by-layer load of %d blocks failed after they were registered: %s",
                       len(layered.keys), result.error)
            self._drop_layered(layered)
            return
        self._manager.complete_load(layered.plan, layered.keys)
        for block in layered.registered:
            self._cache.release(block)
        self._cache.return_blocks(layered.unregistered)

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

    def _holding(self) -> bool:
        """Whether jobs in flight hold engine blocks (:meth:`_drain` waits for them)."""
        return bool(self._stores or self._demotions or self._layered or self._late_loads)

    def _drain(self, worker: WorkerLike, timeout: float) -> None:
        """Wait for every demotion, store (and the stores that follow the demotions), layer-by-layer
        load and late load: each holds engine blocks (a late load's go back to the pool when it
        finished)."""
        self._flush(worker, self._stream())
        while self._holding():
            jobs = list(self._demotions) + list(self._stores) + list(self._layered) + list(self._late_loads)
            self._collect(worker.wait(jobs, timeout=timeout))

    # ------------------------------------------------------------------ user thread

    def close(self, timeout: float) -> None:
        """Stop the hooks and shut the worker down (draining its jobs); idempotent.

        The references held for stores stay until the generation thread's next step (if any)
        releases them; the engine's cache is no longer used from here.

        Raises:
            ShutdownError: from the worker's shutdown, after everything was released.
            TransferError: the worker shut down, but a layer-by-layer load did not land within half
                of ``timeout`` (a request in flight may read its blocks after the exit).
        """
        with self._lock:  # a forward's layer hooks look here: they find every load landed or refused
            if self._closed:
                return
            deadline = time.monotonic() + timeout  # from here: a step may have held the lock a while
            self._close_deadline = deadline + _SHUTDOWN_SLACK_S
            if self._worker is not None and self._layered:  # half the time: the worker's shutdown
                self._land_layered(self._worker, timeout / 2)  # drains the stores with the rest
                self._unlanded = {job for job in self._layered if job not in self._landed}
                if self._cache is not None:  # no later request may match blocks a copy may still write
                    for job in self._unlanded:
                        for block in self._layered[job].registered:
                            self._cache.forget(block)
            self._closed = True
            worker, self._worker = self._worker, None
            cache = self._cache
        if cache is not None:
            cache.stop_intercepting()
        stopped = False
        try:
            if worker is not None:
                worker.shutdown(max(0.0, deadline - time.monotonic()))
            stopped = True
        except kvoffload.ShutdownError as exc:
            stopped = not exc.region_left_mapped  # the device was proven idle: no copy runs
            raise
        finally:
            with self._lock:  # the generation thread's next step gives the blocks back, or keeps them
                self._stopped = stopped
            self._stop_known.set()
        if self._unlanded:  # the copies stopped, but whether they wrote their blocks is not known
            raise kvoffload.TransferError(
                f"{len(self._unlanded)} layer-by-layer load(s) did not land within half the exit's "
                f"shutdown_timeout ({timeout / 2:.3g} s): the steps that ran during the exit failed, "
                "but a request that matched their blocks and runs a step after the exit reads blocks "
                "the load may not have written (forwards after the exit run no hooks); abort the "
                "requests in flight, or give the exit a longer shutdown_timeout"
            )

    def _land_layered(self, worker: WorkerLike, timeout: float) -> None:
        """At close (user thread, lock held): submit the deferred loads and wait for every layered
        load, so that a forward still running after the hooks are gone reads landed blocks. The
        blocks stay with the session until the generation thread's next step releases them (those
        whose load did not land are dropped from the engine's cache then)."""
        try:
            for job, layered in self._layered.items():
                if layered.load is None:
                    layered.submit(worker, job, self._stream())
            for result in worker.wait(list(self._layered), timeout=timeout):
                if result.ok:
                    self._landed.add(result.job_id)
        except kvoffload.KVOffloadError as exc:
            _log.error("layer-by-layer loads did not land before close; their blocks are dropped: %s", exc)

    def manager_stats(self) -> kvoffload.ManagerStats:
        """The session's manager statistics (lock held by the caller)."""
        return self._manager.stats()
