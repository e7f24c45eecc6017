"""Every private name of transformers' continuous batching that kvoffload's integration touches.

transformers has no public hook for an offload tier. Its one extension point is the scheduler
registry; the rest is private and may move in any release. This module is the only place in
kvoffload that names it, so that an upgrade breaks here and in the canary tests that check each
name (``tests/unit/test_transformers_surface.py``), never somewhere else. The supported releases
are :data:`SUPPORTED_RANGE`; :func:`check_surface` verifies every name below before any hook is
installed.

What is used, and what the integration relies on (transformers 5.24):

* ``continuous_batching.scheduler.SCHEDULER_MAPPING``: name -> scheduler class. A session builds
  ``SCHEDULER_MAPPING[cb_config.scheduler_type](cache=, safety_margin=, max_requests_per_batch=)``
  once, after its ``PagedAttentionCache``. The entries are replaced (while at least one model is
  registered) by factories that build a subclass with two hooks for registered models' caches.
* ``Scheduler.schedule_batch(token_budget, cache_budget)``: one call per step, in the generation
  thread, after the previous step's outputs were applied; returns ``(list[FutureRequestState] |
  None, ...)``, None when nothing fits in the cache (the caller then evicts or offloads requests
  and calls it again). ``FutureRequestState.state`` / ``.query_length``. ``Scheduler.starved_requests``:
  the active requests that did not get cache in that step (the caller then offloads requests).
* ``Scheduler._infer_request_tokens(state, ids)``: where a pending request's prompt is matched
  against the ledger (``cache.search_prefix_match``) under the same conditions as
  :func:`_matches_prefix`. A host hit is loaded and registered just before it.
* ``PagedAttentionCache``: ``cache_tensor`` (one flat ``uint8`` tensor for every attention group),
  ``cache_allocators`` (a full-attention model has one, ``"full_attention"``), ``pool``,
  ``use_prefix_sharing``, ``config``.
* The full-attention ``CacheAllocator``: ``index``, ``tokens_per_page``, ``bytes_per_block``,
  ``blocks_per_sector``, ``ledger``. Block ``b`` is bytes ``[b * bytes_per_block, (b + 1) *
  bytes_per_block)`` of ``cache_tensor``: every layer's K and V of ``tokens_per_page`` tokens,
  contiguous (one cross-layer tensor with block dim 0 in kvoffload's terms). Blocks of the two
  leading trash sectors are never handed out.
* ``BlockLedger``: ``hash_to_block`` / ``block_to_hash`` (complete blocks by content hash),
  ``register_new_hash(block, hash)`` (None when registered), ``acquire(block)`` / ``release(block)``
  (reference counts; an unreferenced hashed block is kept as an evictable cached block),
  ``cached_blocks`` (the unreferenced complete blocks, in the order they became unreferenced).
  Complete blocks are never written again; a block leaves the ledger only by eviction of an
  unreferenced block, a ``no_cache`` release of its last reference, or a ledger reset.
* ``CachePool``: ``count_free_blocks``, ``num_free_sectors``, ``allocate_sector``,
  ``get_free_blocks``, ``free_blocks``.
* ``cache_allocator.compute_block_hash(parent, tokens)``: blake2b, 8 bytes, chained from the first
  block: stable across processes. ``match_prefix_blocks`` hashes blocks ``0 .. (len(prompt) - 1)
  // tokens_per_page - 1`` (the block holding the last prompt token is never matched).
* ``RequestState``: ``request_id``, ``status``, ``is_cpu_offloaded``, ``remaining_prefill_tokens``,
  ``initial_tokens``, ``position_offset``; ``RequestStatus.PENDING``.
* ``cache.group_layers_by_attn_type(config)``: the attention groups of a model.
* The allocator's ``layer_indices``: the model layers of the group, in the order their K and V lie
  in a block (``[K, V of layer_indices[0] | K, V of layer_indices[1] | ...]``, equal halves).
* The model's attention modules: submodules named ``*.self_attn`` with an int ``layer_idx``; the
  paged attention writes and reads layer ``layer_idx``'s cache inside that module's forward, on the
  compute stream.
* Behaviour: the forward runs as ``model(**batch)`` inside the compute stream's context (a forward
  pre-hook sees that stream as current); with synchronous batching the compute stream has finished
  before the step's outputs are applied.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import torch

__all__ = [
    "SUPPORTED_RANGE",
    "EngineCache",
    "ScheduledChunk",
    "SchedulerHooks",
    "SurfaceError",
    "attention_groups",
    "attention_layers",
    "check_surface",
    "installed_version",
    "register_model",
    "unregister_model",
    "version_supported",
]

SUPPORTED_RANGE: Final = ">=5.24,<5.25"
"""The transformers releases whose private surface this module was written against."""

_LOWEST: Final = (5, 24)
_FIRST_UNSUPPORTED: Final = (5, 25)
_CB: Final = "transformers.generation.continuous_batching"
FULL_ATTENTION: Final = "full_attention"


class SurfaceError(Exception):
    """A private name this module relies on is missing or changed shape; the message lists them."""


def installed_version() -> str | None:
    """The installed transformers version, or None when it is not installed (transformers is not
    imported)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_supported(version: str) -> bool:
    """Whether ``version`` (e.g. ``"5.24.0"``, ``"5.25.0.dev0"``) lies in :data:`SUPPORTED_RANGE`."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return False
    major_minor = (int(found.group(1)), int(found.group(2)))
    return _LOWEST <= major_minor < _FIRST_UNSUPPORTED


def _module(name: str) -> Any:
    return importlib.import_module(f"{_CB}.{name}" if name else _CB)


def _params(func: object) -> list[str]:
    return list(inspect.signature(func).parameters)  # type: ignore[arg-type]


# (module, attribute path, what it must be): every private name used below.
_NAMES: Final[tuple[tuple[str, str, str], ...]] = (
    ("scheduler", "SCHEDULER_MAPPING", "dict"),
    ("scheduler", "Scheduler", "class"),
    ("scheduler", "Scheduler.schedule_batch", "token_budget,cache_budget"),
    ("scheduler", "Scheduler._infer_request_tokens", "state,request_ids_to_remove_from_waiting"),
    ("scheduler", "Scheduler.__init__", "cache,safety_margin,max_requests_per_batch"),
    ("cache", "PagedAttentionCache.search_prefix_match", "request_id,prompt_ids"),
    ("cache", "group_layers_by_attn_type", "config"),
    ("cache_allocators.cache_allocator", "compute_block_hash", "parent_hash,tokens"),
    ("cache_allocators.cache_allocator", "BlockLedger.register_new_hash", "block_id,block_hash"),
    ("cache_allocators.cache_allocator", "BlockLedger.acquire", "block_id"),
    ("cache_allocators.cache_allocator", "BlockLedger.release", "block_id,no_cache"),
    ("cache_allocators.cache_allocator", "CacheAllocator.match_prefix_blocks", "prompt_ids"),
    ("cache_allocators.cache_pool", "CachePool.count_free_blocks", "index"),
    ("cache_allocators.cache_pool", "CachePool.allocate_sector", "index"),
    ("cache_allocators.cache_pool", "CachePool.get_free_blocks", "index,num_blocks"),
    ("cache_allocators.cache_pool", "CachePool.free_blocks", "index,block_ids"),
    ("cache_allocators.cache_pool", "CachePool.num_free_sectors", "property"),
    ("cache_allocators.full_attention", "FullAttentionCacheAllocator.layer_type", FULL_ATTENTION),
    ("requests", "RequestStatus.PENDING", "enum"),
    ("requests", "FutureRequestState.__init__", "state,has_new_token,complete_blocks,query_length"),
)
_LEDGER_FIELDS: Final = ("hash_to_block", "block_to_hash", "cached_blocks", "shared_ref_counts")
_STATE_FIELDS: Final = ("request_id", "initial_tokens", "position_offset", "remaining_prefill_tokens",
                        "is_cpu_offloaded")


def check_surface() -> None:
    """Import transformers' continuous batching and check every private name this module uses.

    Raises:
        SurfaceError: listing each name that is missing or whose signature or kind changed.
    """
    problems: list[str] = []
    for module_name, path, expected in _NAMES:
        try:
            value: Any = _module(module_name)
            *owners, name = path.split(".")
            for part in owners:
                value = getattr(value, part)
            value = inspect.getattr_static(value, name) if expected == "property" else getattr(value, name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module_name}.{path}: missing ({exc})")
            continue
        where = f"{module_name}.{path}"
        if expected == "dict":
            if not isinstance(value, dict) or not all(
                isinstance(v, (type, _SchedulerFactory)) for v in value.values()
            ):
                problems.append(f"{where}: expected a dict of scheduler classes, found {type(value).__name__}")
        elif expected == "class":
            if not isinstance(value, type):
                problems.append(f"{where}: expected a class")
        elif expected == "property":
            if not isinstance(value, property):
                problems.append(f"{where}: expected a property")
        elif expected == "enum":
            if int(value) != 0:
                problems.append(f"{where}: expected the value 0, found {int(value)}")
        elif expected == FULL_ATTENTION:
            if value != FULL_ATTENTION:
                problems.append(f"{where}: expected {FULL_ATTENTION!r}, found {value!r}")
        else:
            params = [p for p in _params(value) if p != "self"]
            if params != expected.split(","):
                problems.append(f"{where}: expected parameters ({expected}), found ({','.join(params)})")
    try:
        ledger = _module("cache_allocators.cache_allocator").BlockLedger()
        missing = [f for f in _LEDGER_FIELDS if not isinstance(getattr(ledger, f, None), dict)]
        if missing:
            problems.append(f"BlockLedger(): fields {missing} are missing or not dicts")
        state = _module("requests").RequestState(request_id="r", initial_tokens=[1, 2])
        missing = [f for f in _STATE_FIELDS if not hasattr(state, f)]
        if missing:
            problems.append(f"RequestState: fields {missing} are missing")
    except Exception as exc:  # a constructor that changed shape is a moved surface too
        problems.append(f"constructing BlockLedger / RequestState failed: {type(exc).__name__}: {exc}")
    if problems:
        raise SurfaceError("; ".join(problems))


def attention_groups(config: object) -> dict[str, list[int]]:
    """The model's attention groups as transformers' continuous batching forms them (name -> layers).

    Raises:
        SurfaceError: when transformers rejects the config's layer types.
    """
    try:
        groups = _module("cache").group_layers_by_attn_type(config)
    except ValueError as exc:
        raise SurfaceError(f"group_layers_by_attn_type refused the config: {exc}") from exc
    return {str(k): [int(i) for i in v] for k, v in groups.items()}


# ------------------------------------------------------------------------------------ the cache


class EngineCache:
    """The engine's paged cache of one session, seen through its single full-attention group.

    Borrows the engine's ``PagedAttentionCache`` (and through it the cache tensor); owns only the
    interception of new block hashes, removed by :meth:`stop_intercepting`. Every method must be
    called from the engine's generation thread (the ledger and the pool are not thread-safe), except
    :meth:`stop_intercepting`, which only detaches an attribute.
    """

    def __init__(self, cache: Any) -> None:
        """Wrap ``cache`` (a ``PagedAttentionCache``).

        Raises:
            SurfaceError: the cache has more than one attention group or a group that is not full
                attention (transformers shares prefixes only between full-attention blocks).
        """
        allocators = dict(cache.cache_allocators)
        if list(allocators) != [FULL_ATTENTION]:
            raise SurfaceError(
                f"the cache's attention groups are {list(allocators)}; only a model whose layers are all "
                f"{FULL_ATTENTION!r} shares prefix blocks"
            )
        self._cache = cache
        self._allocator = allocators[FULL_ATTENTION]
        self._ledger = self._allocator.ledger
        self._pool = cache.pool
        self._index = int(self._allocator.index)
        self.tokens_per_block: int = int(self._allocator.tokens_per_page)
        self.bytes_per_block: int = int(self._allocator.bytes_per_block)
        self._blocks_per_sector = int(self._allocator.blocks_per_sector)
        self._hash = _module("cache_allocators.cache_allocator").compute_block_hash
        self._register = type(self._ledger).register_new_hash  # the class's, never our interception
        self._interception: Callable[[int, int], object] | None = None

    @property
    def engine_cache(self) -> object:
        """The wrapped ``PagedAttentionCache`` (borrowed)."""
        return self._cache

    @property
    def config(self) -> object:
        """The text config the cache was built for (the model's ``config.get_text_config()``)."""
        return self._cache.config

    @property
    def prefix_sharing(self) -> bool:
        """Whether the engine matches prompt prefixes against complete blocks in this session."""
        return bool(self._cache.use_prefix_sharing)

    def block_view(self) -> torch.Tensor:
        """The cache tensor as ``uint8 [num_blocks, bytes_per_block]``: row ``b`` is block ``b``
        (every layer's K and V), trash blocks included. A view of the engine's memory (borrowed)."""
        tensor = self._cache.cache_tensor
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 and tensor.dim() == 1
        return tensor.view(-1, self.bytes_per_block)

    @property
    def layer_order(self) -> tuple[int, ...]:
        """The model layers whose K and V a block holds, in the order they lie in the block: block
        ``b`` is ``[K, V of layer_order[0] | K, V of layer_order[1] | ...]``, each pair
        ``bytes_per_block // len(layer_order)`` bytes (the allocator's ``layer_indices``)."""
        order = tuple(int(i) for i in self._allocator.layer_indices)
        if not order or self.bytes_per_block % len(order):
            raise SurfaceError(
                f"layer_indices = {list(order)} does not divide a block of {self.bytes_per_block} bytes"
            )
        return order

    def layer_block_view(self) -> torch.Tensor:
        """:meth:`block_view` as ``uint8 [num_blocks, layers, bytes_per_layer]``: ``[b, i]`` is the K
        and V of model layer ``layer_order[i]`` in block ``b`` (a cross-layer tensor, layer dim 1)."""
        layers = len(self.layer_order)
        return self.block_view().view(-1, layers, self.bytes_per_block // layers)

    def block_hashes(self, prompt: Sequence[int]) -> list[int]:
        """The chained hashes of the prompt's blocks the engine may match (all complete blocks but
        the one holding the last token), first block first."""
        size = self.tokens_per_block
        hashes: list[int] = []
        parent: int | None = None
        for b in range((len(prompt) - 1) // size):
            parent = int(self._hash(parent, list(prompt[b * size:(b + 1) * size])))
            hashes.append(parent)
        return hashes

    def resident_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The engine blocks holding the leading ``hashes`` that are complete in its cache."""
        known = self._ledger.hash_to_block
        blocks: list[int] = []
        for h in hashes:
            block = known.get(h)
            if block is None:
                break
            blocks.append(int(block))
        return blocks

    def evict_cached(self, count: int, keep: Sequence[int] = ()) -> int:
        """Evict up to ``count`` unreferenced complete blocks, those cached the longest first, never
        one of ``keep``, as the engine's own eviction does (their hashes are forgotten and they
        return to the pool). Returns how many were evicted."""
        ledger = self._ledger
        spared = set(keep)
        victims: list[int] = []
        for block in ledger.cached_blocks:
            if len(victims) >= count:
                break
            if block not in spared:
                victims.append(block)
        for block in victims:
            del ledger.cached_blocks[block]
            del ledger.hash_to_block[ledger.block_to_hash.pop(block)]
        self.return_blocks(victims)
        return len(victims)

    def hash_of(self, block: int) -> int | None:
        """The content hash registered for ``block``, or None."""
        value = self._ledger.block_to_hash.get(block)
        return None if value is None else int(value)

    def available_blocks(self) -> int:
        """Blocks :meth:`take_blocks` can hand out now without evicting anything."""
        free = int(self._pool.count_free_blocks(self._index))
        return free + int(self._pool.num_free_sectors) * self._blocks_per_sector

    def take_blocks(self, count: int) -> list[int]:
        """Take ``count`` free blocks (claiming free sectors as needed), owned by the caller until
        :meth:`return_blocks` or :meth:`register_held`. Requires ``count <= available_blocks()``."""
        if count > self.available_blocks():
            raise SurfaceError(f"take_blocks({count}): only {self.available_blocks()} blocks are free")
        missing = count - int(self._pool.count_free_blocks(self._index))
        for _ in range(max(0, -(-missing // self._blocks_per_sector))):
            self._pool.allocate_sector(self._index)
        return [int(b) for b in self._pool.get_free_blocks(self._index, count)]

    def return_blocks(self, blocks: Sequence[int]) -> None:
        """Give blocks from :meth:`take_blocks` that were never registered back to the pool."""
        if blocks:
            self._pool.free_blocks(self._index, list(blocks))

    def register_held(self, blocks: Sequence[int], hashes: Sequence[int]) -> int:
        """Register ``hashes[i]`` for the caller's ``blocks[i]``, in order, as complete blocks that the
        caller holds one reference to (release it with :meth:`release`). Stops at the first hash the
        ledger already knows; returns how many were registered (the rest stay the caller's)."""
        for i, (block, block_hash) in enumerate(zip(blocks, hashes)):
            if self._register(self._ledger, block, block_hash) is not None:
                return i
        return len(blocks)

    def hold(self, block: int) -> None:
        """Take one reference to a complete (hashed) block: it is not evicted while held."""
        self._ledger.acquire(block)

    def release(self, block: int) -> None:
        """Drop a reference taken by :meth:`hold` or :meth:`register_held`; an unreferenced complete
        block becomes an evictable cached block."""
        if self._ledger.release(block):
            self._pool.free_blocks(self._index, [block])

    def forget(self, block: int) -> None:
        """Drop ``block``'s hash from the ledger (its bytes are not what the hash says): no prefix
        match shares it again. Its references stay; released by the last, it returns to the pool."""
        block_hash = self._ledger.block_to_hash.pop(block, None)
        if block_hash is not None and self._ledger.hash_to_block.get(block_hash) == block:
            del self._ledger.hash_to_block[block_hash]

    def intercept_new_hashes(self, callback: Callable[[int, int], None]) -> None:
        """Call ``callback(block, hash)`` after the engine registers a block as complete (and not as a
        duplicate of a known block). Replaces any previous interception of this cache."""
        self.stop_intercepting()
        register = self._register
        ledger = self._ledger

        def register_new_hash(block_id: int, block_hash: int) -> object:
            identical = register(ledger, block_id, block_hash)
            if identical is None:
                callback(int(block_id), int(block_hash))
            return identical

        ledger.register_new_hash = register_new_hash
        self._interception = register_new_hash

    def stop_intercepting(self) -> None:
        """Remove the interception installed by :meth:`intercept_new_hashes` (idempotent)."""
        mine, self._interception = self._interception, None
        if mine is not None and vars(self._ledger).get("register_new_hash") is mine:
            del self._ledger.register_new_hash


# ------------------------------------------------------------------------------ the scheduler


class ScheduledChunk:
    """One request's part of a scheduled step: ``tokens`` query tokens, prompt tokens or not."""

    __slots__ = ("prompt", "tokens")

    def __init__(self, tokens: int, prompt: bool) -> None:
        self.tokens = tokens
        self.prompt = prompt


class SchedulerHooks(Protocol):
    """What the hooked scheduler calls, in the generation thread. Inactive hooks make the scheduler
    behave exactly as the one it subclasses."""

    @property
    def active(self) -> bool:
        """Whether the hooks run (False once the integration is closed)."""

    def before_schedule(self) -> bool:
        """A step is being scheduled: the previous step's outputs were applied. False: the hooks are
        inactive (closed); the step is then scheduled as the engine's own scheduler does."""

    def before_prefix_match(self, prompt: Sequence[int]) -> object:
        """A pending request's prompt is about to be matched against the cache; returns a token for
        :meth:`after_prefix_match`."""

    def after_prefix_match(self, token: object, matched_tokens: int) -> None:
        """The match of :meth:`before_prefix_match` found ``matched_tokens`` prompt tokens."""

    def after_schedule(self, chunks: list[ScheduledChunk] | None, starved: bool) -> bool:
        """The step was scheduled (None: nothing fit; ``starved``: some active requests did not get
        the cache they need). True asks for one more scheduling attempt (only after None)."""


_log = logging.getLogger(__name__)


class _Registry:
    """Models whose sessions get hooked schedulers (by the model object: models built from one
    config object share it), and the wrapped mapping."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hooks: dict[int, tuple[object, Callable[[EngineCache], SchedulerHooks | None]]] = {}
        self.originals: dict[str, Any] = {}
        self.unknown_builder_logged = False

    def shares_config(self, cache: Any) -> bool:
        """Whether a registered model's text config is the one ``cache`` was built for."""
        with self.lock:
            models = [entry[0] for entry in self.hooks.values()]
        for registered in models:
            config = getattr(registered, "config", None)
            text = getattr(config, "get_text_config", None)
            if text is not None and text() is getattr(cache, "config", None):
                return True
        return False

    def resolve(self, model: object) -> Callable[[EngineCache], SchedulerHooks | None] | None:
        with self.lock:
            entry = self.hooks.get(id(model))
        if entry is None or entry[0] is not model:
            return None
        return entry[1]


_REGISTRY: Final = _Registry()


def _building_model() -> object | None:
    """The model whose continuous-batching manager builds the scheduler being made: the ``model``
    of the ``self`` of the function that called the scheduler class (transformers 5.24 builds it in
    ``ContinuousBatchingManager._create_batch_processor``). None when the caller has none. The
    cache alone does not tell: it holds the model's text config, which models built from one
    config object share (keyed by it, a context of one model hooked another's sessions, whose
    layers it does not hook: their deferred loads were never waited for)."""
    caller = sys._getframe(2)  # _building_model <- _SchedulerFactory.__call__ <- the builder
    owner = caller.f_locals.get("self")
    return getattr(owner, "model", None) if owner is not None else None


class _SchedulerFactory:
    """Stands in for a scheduler class in ``SCHEDULER_MAPPING``: builds the original class, or, for a
    registered model's cache, a subclass of it with the hooks."""

    def __init__(self, original: type) -> None:
        self.original = original
        self.hooked: type = type(f"KVOffload{original.__name__}", (_HookedScheduler, original), {})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", args[0] if args else None)
        model = _building_model()
        if model is None and _REGISTRY.hooks and not _REGISTRY.unknown_builder_logged:
            _REGISTRY.unknown_builder_logged = True
            _log.warning("a %s was built by code that names no model: its sessions are not offloaded",
                         self.original.__name__)
        bind = _REGISTRY.resolve(model) if cache is not None and model is not None else None
        if bind is None:
            if model is not None and cache is not None and _REGISTRY.shares_config(cache):
                _log.warning("a session of a %s whose config is a registered model's is not offloaded: "
                             "only the model given to offloading() is (a wrapper of it other than "
                             "torch.compile's, or another model built from its config object, is "
                             "another model)", type(model).__name__)
            return self.original(*args, **kwargs)
        hooks = bind(EngineCache(cache))
        if hooks is None:
            return self.original(*args, **kwargs)
        scheduler = self.hooked(*args, **kwargs)
        scheduler._kvoffload_hooks = hooks
        return scheduler


class _HookedScheduler:
    """Mixed in front of an engine scheduler class: loads host hits just before the prefix match,
    and tells the hooks about every step."""

    _kvoffload_hooks: SchedulerHooks
    starved_requests: list[Any]

    def schedule_batch(self, token_budget: int, cache_budget: int) -> Any:
        hooks = self._kvoffload_hooks
        schedule = super().schedule_batch  # type: ignore[misc]
        if not hooks.before_schedule():
            return schedule(token_budget, cache_budget)
        result = schedule(token_budget, cache_budget)
        if hooks.after_schedule(_chunks(result[0]), bool(self.starved_requests)):
            result = schedule(token_budget, cache_budget)
            hooks.after_schedule(_chunks(result[0]), bool(self.starved_requests))
        return result

    def _infer_request_tokens(self, state: Any, request_ids_to_remove_from_waiting: set[str]) -> Any:
        hooks = self._kvoffload_hooks
        infer = super()._infer_request_tokens  # type: ignore[misc]
        if not (hooks.active and _matches_prefix(self, state)):
            return infer(state, request_ids_to_remove_from_waiting)
        before = int(state.position_offset)
        token = hooks.before_prefix_match(list(state.remaining_prefill_tokens))
        try:
            return infer(state, request_ids_to_remove_from_waiting)
        finally:
            hooks.after_prefix_match(token, int(state.position_offset) - before)


def attention_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's attention modules by layer index: every submodule named ``*.self_attn`` with an
    int ``layer_idx`` (transformers' decoder attention; the engine's paged attention writes and reads
    layer ``layer_idx``'s cache inside that module's forward).

    Raises:
        SurfaceError: two modules claim one layer.
    """
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        index = getattr(module, "layer_idx", None)
        if not name.endswith("self_attn") or isinstance(index, bool) or not isinstance(index, int):
            continue
        if index in found:
            raise SurfaceError(f"two attention modules claim layer {index} (the second is {name!r})")
        found[index] = module
    return found


def _matches_prefix(scheduler: Any, state: Any) -> bool:
    """The condition under which ``Scheduler._infer_request_tokens`` runs the prefix match."""
    pending = _module("requests").RequestStatus.PENDING
    return bool(scheduler.cache.use_prefix_sharing and state.status == pending and not state.is_cpu_offloaded)


def _chunks(scheduled: Any) -> list[ScheduledChunk] | None:
    if scheduled is None:
        return None
    return [
        ScheduledChunk(int(f.query_length), int(f.state.position_offset) < len(f.state.initial_tokens))
        for f in scheduled
    ]


def register_model(model: object, bind: Callable[[EngineCache], SchedulerHooks | None]) -> None:
    """Hook the schedulers of every session ``model``'s continuous-batching manager builds from now
    on (another model's, of the same config object or not, are left alone): ``bind(cache)`` is
    called when such a session builds its scheduler (in its generation thread) and returns the
    hooks, or None for a plain scheduler. The first registration wraps every entry of
    ``SCHEDULER_MAPPING``.

    Raises:
        SurfaceError: ``model`` is registered already.
    """
    mapping = _module("scheduler").SCHEDULER_MAPPING
    with _REGISTRY.lock:
        if id(model) in _REGISTRY.hooks:
            raise SurfaceError("this model is registered already")
        _REGISTRY.hooks[id(model)] = (model, bind)
        if len(_REGISTRY.hooks) == 1:
            for name, cls in list(mapping.items()):
                if isinstance(cls, type):
                    _REGISTRY.originals[name] = cls
                    mapping[name] = _SchedulerFactory(cls)


def unregister_model(model: object) -> None:
    """Undo :func:`register_model`; the last one puts back every mapping entry it replaced (an entry
    replaced by someone else meanwhile is left alone). Sessions already built keep their scheduler.
    Idempotent."""
    mapping = _module("scheduler").SCHEDULER_MAPPING
    with _REGISTRY.lock:
        entry = _REGISTRY.hooks.get(id(model))
        if entry is None or entry[0] is not model:
            return
        del _REGISTRY.hooks[id(model)]
        if _REGISTRY.hooks:
            return
        for name, cls in _REGISTRY.originals.items():
            current = mapping.get(name)
            if isinstance(current, _SchedulerFactory) and current.original is cls:
                mapping[name] = cls
        _REGISTRY.originals.clear()


def mapping_is_original() -> bool:
    """Whether no entry of ``SCHEDULER_MAPPING`` is one of this module's factories."""
    mapping = _module("scheduler").SCHEDULER_MAPPING
    return not any(isinstance(v, _SchedulerFactory) for v in mapping.values())
