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
  blocks after the resident prefix are looked up; the leading hits are loaded into free engine
  blocks, ordered after the compute stream, and registered in the engine's cache, so its prefix
  match shares them and prefill runs only on the rest. Host hits are loaded layer by layer
  (``Worker.load_by_layer``) and not waited for: a forward pre-hook on every attention module makes
  the compute stream wait, on the device, until that layer's pages of every load in flight have
  landed. On CUDA a host hit's load is submitted when the next forward starts (after the engine's
  own input copies of the step, which would otherwise queue behind it on the copy engine), so the
  copies run under the forward's kernel launches. Disk hits (records through pinned bounce buffers,
  checked as they are read) are waited for before they are registered. A load that is refused or
  fails before registration (or does not finish within ``load_timeout``) registers nothing from the
  first failed block on: those tokens are recomputed. A layer-by-layer load fails after
  registration only when the device does (a copy's error) or when a deferred submit is refused: its
  blocks are then dropped from the engine's cache and the step raises ``TransferError`` (the engine
  fails its requests) rather than emitting tokens from them. ``overlap_loads=False`` waits for host
  hits too, before registering them. Once the engine captures a CUDA graph of the model
  (``use_cuda_graph``; its replays run no hooks), host hits are waited for too.
* Room for a load is made by evicting cached engine blocks (every complete block is stored, so the
  host pool normally holds them), never the prompt's resident prefix. When the engine's cache is
  short while stores still hold blocks (a step in which nothing fit or active requests starved, or a
  load without room), those stores are waited for, so that the engine may evict the blocks; after a
  step in which nothing fit, the step is scheduled again. These are the only cases where the
  scheduler waits for a store.

Disk records are demoted under the engine's block hashes, named in their headers and checked on
every disk load. With ``DiskConfig(reuse=True)`` a session opens the tier file warm and takes the
records an earlier session or process demoted for the same model, dtype, block size and layout
(``OffloadStats.blocks_adopted_disk``): a prefix computed before a restart is a disk hit after
it. ``model_id=`` (required then) names the weights, since the config does not. Without ``reuse``
each session recreates the file empty.

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
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final

import attrs
import torch

import kvoffload
from kvoffload import DiskConfig
from kvoffload.integrations import _transformers_surface as surface
from kvoffload.integrations._transformers_session import (
    LayerWaiter,
    OffloadStats,
    UnsupportedEngineError,
    WorkerFactory,
    WorkerLike,
    _Counters,
    _Session,
)

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "LayerWaiter",
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
_POLICIES: Final = ("lru", "arc")


class Offloader:
    """The handle ``offloading()`` yields: statistics, and the sessions it offloads.

    Owns the sessions' workers (through them the host pools) and the forward hook on the model;
    everything is released when the ``offloading`` context exits. Thread-safe.
    """

    def __init__(self, model: Any, num_host_blocks: int, disk: DiskConfig | None, policy: str,
                 make_worker: WorkerFactory, load_timeout: float, model_id: str | None, overlap_loads: bool,
                 defer_loads: bool, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        self.model = model
        self.num_host_blocks = num_host_blocks
        self.disk = disk
        self.policy = policy
        self.load_timeout = load_timeout
        #: The bound of a session's close: the exit's, and a replaced session's at a bind.
        self.shutdown_timeout = shutdown_timeout
        self._make_worker = make_worker
        self._model_id = model_id
        self._overlap_loads = overlap_loads
        self._defer_loads = defer_loads
        self._graphs_seen = False
        self._lock = threading.RLock()
        # One bind at a time (a bind retires the session before it); the exit waits for one in
        # progress, so that it closes the session that bind installs.
        self._bind_lock = threading.Lock()
        self._counts = _Counters()
        self._session: _Session | None = None
        # The session being closed, by the context's exit or by a new session of the model that
        # replaces it: the layer hooks still ask it while the close runs (a forward then must not
        # read a load the close has not landed, or could not land).
        self._closing: _Session | None = None
        self._last_manager: kvoffload.ManagerStats | None = None
        self._compute_stream: object = None
        self._closed = False
        # The engine caches of replaced sessions whose close gave up a layer-by-layer load: a
        # forward of such an engine fails before its layers run (weak: the engine owns its cache).
        self._failed_engines: weakref.WeakSet[Any] = weakref.WeakSet()
        # The engine cache of the forward running on each generation thread (its layer hooks ask
        # the set above too: the retire may add the engine between the forward's start and a layer).
        self._forward = threading.local()

    def stats(self) -> OffloadStats:
        """A snapshot of :class:`OffloadStats`."""
        with self._lock:
            manager = self._session.manager_stats() if self._session is not None else self._last_manager
            return OffloadStats(manager=manager, **attrs.asdict(self._counts))

    def _bind(self, cache: surface.EngineCache) -> _Session | None:
        """Called when a session of the model builds its scheduler (generation thread)."""
        with self._bind_lock:
            return self._bind_one(cache)

    def _bind_one(self, cache: surface.EngineCache) -> _Session | None:
        with self._lock:
            if self._closed:
                return None
            previous, self._session = self._session, None
            if previous is not None:  # the hooks ask it until its close landed its loads
                self._closing = previous
        if previous is not None:
            self._retire(previous)
        if not cache.prefix_sharing:
            _log.warning("the engine does not share prefixes in this session (allow_block_sharing="
                         "False): kvoffload is not used")
            with self._lock:
                self._counts.sessions_without_prefix_sharing += 1
            return None
        # one cross-layer tensor: [block, layer (in the block's order), K and V of that layer]
        order = cache.layer_order
        layout = kvoffload.DeviceLayout.from_tensors({"kv_cache": cache.layer_block_view()}, block_dim=0,
                                                     layer_dim=1)
        layer_of = {layer: i for i, layer in enumerate(order)} if self._overlap_loads else None
        # The model as it is now (its dtype or attention may have changed since the context began)
        identity = _identity(self.model, self._model_id)
        manager = kvoffload.Manager.create(
            self.num_host_blocks,
            fingerprint=f"{identity}|tokens_per_block={cache.tokens_per_block}|{layout.fingerprint}",
            num_disk_blocks=self.disk.num_blocks if self.disk is not None else 0,
            policy=self.policy,
        )
        try:
            worker = self._make_worker(layout, self.num_host_blocks, self.disk)
        except kvoffload.KVOffloadError as exc:
            # raised here it would end the engine's generation thread, and its requests would
            # never finish: the session runs without kvoffload instead, said at error level
            _log.error("kvoffload is not used in this engine session: its worker could not be made: %s", exc)
            with self._lock:
                self._counts.sessions_without_worker += 1
            return None
        try:
            adopted = self._adopt(manager, worker)
            session = _Session(self, cache, manager, worker, layer_of, defer_loads=self._defer_loads)
        except BaseException:  # the session never owned the worker: release it here, once
            worker.shutdown()
            raise
        cache.intercept_new_hashes(session.on_new_hash)
        with self._lock:
            closed = self._exited()  # an exit that could not wait for this bind ran meanwhile
            if not closed:
                self._session = session
                self._counts.sessions += 1
                self._counts.blocks_adopted_disk += adopted
        if closed:  # nothing else will close it: release its worker and the cache here
            try:
                session.close(self.shutdown_timeout)
            except kvoffload.KVOffloadError as exc:  # it ran no step: nothing read its blocks
                _log.error("closing a session bound after the context's exit: %s", exc)
            return None
        return session

    def _exited(self) -> bool:
        """Whether the context's exit ran (lock held; read again after a check earlier in a call)."""
        return self._closed

    def _adopt(self, manager: kvoffload.Manager, worker: WorkerLike) -> int:
        """With a tier file opened warm (``DiskConfig(reuse=True)``), the new manager takes the
        records an earlier session or process demoted under its fingerprint (the others are left
        alone, and the manager writes over them as it needs their blocks). Returns how many; a
        refusal is logged and the session starts cold."""
        if self.disk is None or not self.disk.reuse:
            return 0
        try:
            return len(manager.adopt_disk(worker.disk_valid_blocks().values()))
        except kvoffload.KVOffloadError as exc:
            _log.warning("the disk tier's records could not be adopted; this session starts cold: %s", exc)
            return 0

    def _before_forward(self, stream: object) -> None:
        """The model's forward pre-hook (generation thread): submit the deferred loads. A forward
        being captured into a CUDA graph submits nothing and waits for nothing: the engine ran the
        same forward eagerly just before (its capture's warm-up: hooks ran there), and its replays
        run no hooks, so from now on this model's loads are waited for before registration."""
        if _capturing(stream):
            with self._lock:
                if not self._graphs_seen:
                    _log.info("the engine captures CUDA graphs of the model: host hits are waited for from now on")
                self._graphs_seen = True
            return
        with self._lock:
            session = self._session
        if session is not None:
            session.flush_loads(stream)

    def _refuse_failed_engine(self) -> None:
        """The model's and each attention layer's pre-hook (generation thread), for the forward
        this thread runs (its ``cache`` argument, noted by the model's pre-hook).

        Raises:
            TransferError: the forward's engine is that of a session a new one replaced whose
                close gave up a layer-by-layer load: the forward may read those blocks, and the
                layer hooks no longer ask that session.
        """
        if not self._failed_engines:  # every forward of a model with none: one length read
            return
        engine_cache = getattr(self._forward, "engine", None)
        if engine_cache is None:
            return
        with self._lock:
            failed = engine_cache in self._failed_engines
        if failed:
            raise kvoffload.TransferError(
                "this engine's kvoffload session was replaced by a new one of the model, and its "
                "close gave up a layer-by-layer load this forward may read: the step fails rather "
                "than read blocks whose load did not land"
            )

    def _layered_in_flight(self) -> bool:
        """Whether the current session has a layer-by-layer load in flight. Read without the lock
        by the layer hooks (generation thread, the only one that adds loads): every attention layer
        of every step asks, and most steps have none."""
        session = self._session or self._closing
        return session is not None and session.layered_in_flight

    def _before_layer(self, layer: int, stream: object) -> None:
        """The attention pre-hook of model layer ``layer`` (generation thread, in the forward); does
        nothing in a forward being captured (see :meth:`_before_forward`)."""
        if _capturing(stream):
            return
        session = self._session or self._closing  # one read; the session takes the lock itself
        if session is not None:
            session.before_layer(layer, stream)

    def _retire(self, session: _Session) -> None:
        """Close the session a new one of the model replaces (generation thread, building the new
        session's scheduler). A load that close gave up is logged, not raised here: the requests
        that could read its blocks are the old engine's, whose steps fail from then on
        (``fail_later_steps``). While the close runs, the layer hooks still ask the session
        (``_closing``, set by ``_bind``): a forward of its engine that still runs waits for its
        layers (or fails the step on one given up); after it, they ask the new session, if any."""
        with self._lock:
            self._last_manager = session.manager_stats()
        engine = session.engine_cache
        try:
            session.close(self.shutdown_timeout)
        except kvoffload.TransferError as exc:
            _log.error("closing the previous session: %s", exc)
        finally:
            with self._lock:  # the hooks ask the new session, if any, from here
                if session.gave_up_loads and engine is not None:  # its forwards fail from now on
                    self._failed_engines.add(engine)
                if self._closing is session:
                    self._closing = None
            if session.gave_up_loads:  # its engine's requests may have matched those blocks
                session.fail_later_steps()

    def _close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # A bind in progress (retiring the session before it) finishes first, within the timeout;
        # one that does not sees the offloader closed and releases what it built itself.
        waited = self._bind_lock.acquire(timeout=timeout)
        try:
            with self._lock:
                self._closed = True
                session, self._session = self._session, None
                if session is not None:  # (else a retiring session, if any, stays the one asked)
                    self._closing = session
            if session is not None:
                with self._lock:
                    self._last_manager = session.manager_stats()
                try:
                    session.close(max(0.0, deadline - time.monotonic()))
                finally:
                    if not session.gave_up_loads:  # nothing for the layer hooks to refuse: let it go
                        self._closing = None
        finally:
            if waited:
                self._bind_lock.release()


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


def _identity(model: Any, model_id: str | None) -> str:
    """Names the model for the manager's fingerprint, as it is when a session binds: class, config
    digest, dtype, attention implementation (its kernels round differently: KV written under
    ``sdpa`` read under ``eager`` was not bit-exact in bf16) and the engine's name of its weights."""
    config_json = model.config.to_json_string(use_diff=False)
    digest = hashlib.blake2b(config_json.encode("utf-8"), digest_size=16).hexdigest()
    weights = "" if model_id is None else f"|weights={model_id}"
    attention = getattr(model.config.get_text_config(), "_attn_implementation", None)
    return (f"transformers-cb|{type(model).__name__}|config={digest}|dtype={model.dtype}"
            f"|attn={attention}{weights}")


def _check_model_id(model_id: object, disk: DiskConfig | None) -> None:
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise kvoffload.ArgumentTypeError(f"model_id = {model_id!r} must be a non-empty str or None")
    if model_id is None and disk is not None and disk.reuse:
        raise kvoffload.InvalidArgumentError(
            "disk = DiskConfig(reuse=True) needs model_id= naming the model's weights (a checkpoint and "
            "its revision): a warm tier file holds records of earlier processes, and the model's config "
            "and dtype alone do not tell two checkpoints of one architecture apart"
        )


def _unwrapped(model: object) -> object:
    """The module a ``torch.compile`` wrapper wraps (through every layer of wrapping), else
    ``model``. The engine runs the wrapped module: the wrapper hands its attribute reads to it, so
    ``compiled.generate_batch`` is the wrapped module's, whose manager builds the sessions and calls
    the wrapped module's forward. A wrapper that changes what the model computes (an adapter's) is
    another model and stays as it is."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing compiled
    wrapper = getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None
    while wrapper is not None and isinstance(model, wrapper):
        model = model._orig_mod
    return model


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
    # What a session would refuse only once it binds, in the engine's generation thread (which
    # then dies, dropping its requests), is refused here where it can be told already.
    if num_host_blocks > kvoffload.MAX_TIER_BLOCKS:
        raise kvoffload.InvalidArgumentError(
            f"num_host_blocks = {num_host_blocks} is over the most blocks a pool may have, "
            f"{kvoffload.MAX_TIER_BLOCKS} (a size in blocks, not bytes)"
        )
    if disk is not None:
        if not isinstance(disk, DiskConfig):
            raise kvoffload.ArgumentTypeError(f"disk = {disk!r} must be a DiskConfig or None")
        parent = os.path.dirname(os.path.abspath(disk.path))
        if not os.path.isdir(parent):
            raise kvoffload.DiskPathError(
                f"the parent directory {parent!r} of DiskConfig.path = {disk.path!r} does not exist"
            )
    for name, value in (("load_timeout", load_timeout), ("shutdown_timeout", shutdown_timeout)):
        # finite too (NaN, inf and an int too large for a float fail the comparison): the worker's
        # waits and its shutdown take only deadlines a lock can wait for
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not 0 < value <= threading.TIMEOUT_MAX):
            raise kvoffload.InvalidArgumentError(
                f"{name} = {value!r} must be a finite number of seconds > 0"
            )
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
    overlap_loads: bool = True,
    defer_loads: bool | None = None,
    model_id: str | None = None,
) -> Iterator[Offloader]:
    """Offload the KV cache of ``model``'s continuous batching sessions through kvoffload while the
    context is open (see the module docstring for what happens in a session).

    Args:
        model: a transformers model with continuous batching (``generate_batch``), whose layers are
            all full attention, on the CPU or one CUDA device. A ``torch.compile`` wrapper stands
            for the model it wraps (the engine reached through it is that model's); any other
            wrapper (an adapter's) is a model of its own.
        num_host_blocks: host records in each session's pool; one record holds one engine block (every
            layer's K and V of ``page_size`` tokens).
        disk: a disk tier below the host pool (``kvoffload.DiskConfig``), or None. With
            ``reuse=True`` each session opens the file warm and adopts what earlier sessions (or
            processes) of the same ``model_id``, model config, dtype and cache geometry demoted
            there.
        policy: the manager's eviction policy (``"lru"``, ``"arc"``).
        make_worker: builds each session's worker (default ``Worker.create(layout, num_host_blocks,
            disk=disk)``); the integration owns what it returns and shuts it down.
        load_timeout: seconds a scheduling step waits for a load (or, when the cache is full, for the
            stores in flight) before giving up on it: its tokens are then recomputed.
        shutdown_timeout: seconds the exit takes at most once it holds the session (landing the
            layer-by-layer loads in flight, at most half of it, then the worker's shutdown). It
            bounds the close of a session a new one of the model replaces too; a bind in progress is
            waited for within it, except that an exit that meets one landing the replaced
            session's loads waits for that landing too (at most half of it more).
        overlap_loads: load host hits layer by layer without waiting (each attention layer waits
            on the device for its pages); False waits for every load before registering it.
        defer_loads: with ``overlap_loads``, submit a host hit's load when the next forward starts
            rather than at the prefix match (None: on CUDA, where the engine's input copies would
            otherwise queue behind it). A deferred load that the worker refuses fails the step
            (its blocks are registered already); one submitted at once is recomputed instead.
        model_id: names the model's weights (a checkpoint path or hub name with its revision, or a
            digest of the weights); part of every record's name. Required with
            ``DiskConfig(reuse=True)``: records outlive the process, and the config and dtype alone
            do not tell two checkpoints of one architecture apart (a fine-tune, a retrained model
            saved over the old one), whose records would verify and serve the other's KV.

    Yields the :class:`Offloader` (``stats()``). On exit the model's sessions are built with the
    engine's own scheduler again, the hook on the model is removed and every worker is shut down.
    A session still running then continues without kvoffload.

    Raises (before anything is hooked):
        UnsupportedEngineError: transformers missing or not in :data:`SUPPORTED_TRANSFORMERS`, its
            internals moved, or an unsupported model (see the class).
        ArgumentTypeError, InvalidArgumentError: a bad argument (named in the message), or the model
            is inside another ``offloading`` context already; ``DiskPathError`` for a tier file
            whose directory does not exist. What depends on the engine's cache (the host pool's
            memory, a warm tier file of another geometry) is refused when a session binds, in the
            engine's generation thread.
        ShutdownError: on exit, from a worker's shutdown (after everything else was released).
        TransferError: on exit, after a worker shut down, when a layer-by-layer load did not land
            within half of ``shutdown_timeout``: the steps that ran during the exit failed, but a
            request that matched its blocks may run a step after the exit, which runs no hooks and
            would read them unchecked (abort the requests in flight).
    """
    _check_engine()
    model = _unwrapped(model)
    text_config = _check_model(model)
    _check_args(num_host_blocks, disk, load_timeout, shutdown_timeout, make_worker)
    _check_model_id(model_id, disk)
    if not isinstance(overlap_loads, bool):
        raise kvoffload.ArgumentTypeError(f"overlap_loads = {overlap_loads!r} must be a bool")
    if defer_loads is not None and not isinstance(defer_loads, bool):
        raise kvoffload.ArgumentTypeError(f"defer_loads = {defer_loads!r} must be a bool or None")
    layers = surface.attention_layers(model) if overlap_loads else {}
    if overlap_loads and sorted(layers) != list(range(text_config.num_hidden_layers)):
        raise UnsupportedEngineError(
            f"the model's attention modules cover layers {sorted(layers)}, not 0..{text_config.num_hidden_layers - 1}: "
            "layer-by-layer loads cannot be ordered (pass overlap_loads=False)"
        )
    if policy not in _POLICIES:
        raise kvoffload.UnknownPolicyError(f"policy = {policy!r} is not one of {list(_POLICIES)}")
    device = torch.device(model.device)
    offloader = Offloader(model, num_host_blocks, disk, policy, make_worker or _default_worker,
                          float(load_timeout), model_id, overlap_loads,
                          overlap_loads and (defer_loads if defer_loads is not None else device.type == "cuda"),
                          float(shutdown_timeout))
    try:
        surface.register_model(model, offloader._bind)
    except surface.SurfaceError as exc:
        raise kvoffload.InvalidArgumentError(
            f"model = {type(model).__name__} is inside another offloading() context already"
        ) from exc
    handles = []

    def before_forward(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        offloader._forward.engine = kwargs.get("cache")  # this thread's forward, for its layer hooks
        offloader._refuse_failed_engine()
        stream = _current_stream(device)
        offloader._compute_stream = stream
        offloader._before_forward(stream)

    handles.append(model.register_forward_pre_hook(before_forward, with_kwargs=True))
    for layer, module in layers.items():
        handles.append(module.register_forward_pre_hook(_layer_hook(offloader, layer, device)))
    try:
        yield offloader
    finally:
        surface.unregister_model(model)
        try:
            offloader._close(float(shutdown_timeout))  # lands every load first: the hooks may go then
        finally:
            for handle in handles:
                handle.remove()


def _current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The engine's compute stream: the current stream of a CUDA device (None on the CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _capturing(stream: object) -> bool:
    """Whether CUDA work on ``stream`` is being captured into a graph (False on the CPU)."""
    return stream is not None and torch.cuda.is_current_stream_capturing()


def _layer_hook(offloader: Offloader, layer: int, device: torch.device) -> Callable[[torch.nn.Module, Any], None]:
    """The forward pre-hook of model layer ``layer``'s attention: the current stream (the engine's
    compute stream; None on the CPU) waits for that layer of the loads in flight."""
    def hook(module: torch.nn.Module, args: Any) -> None:
        if offloader._layered_in_flight():
            offloader._before_layer(layer, _current_stream(device))
        # after: a retire records a failed engine before the hooks stop asking its session, so a
        # forward that found no session above finds its engine recorded here
        offloader._refuse_failed_engine()

    return hook
