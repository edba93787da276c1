"""PlanCache: key -> memory -> local store -> fleet -> single flight -> build.

The life of a lookup (``get``), top to bottom, each step in the module named after it
(``lookup`` drives the steps below memory):

1. ``key``: describe the graph, add the environment of the caller's current device and the
   build options, hash.
2. ``tiers.memory``: a loaded plan of this process? Return it under the caller's names.
3. ``cache.loads``: one thread per key and device goes on; the others wait for its plan.
4. ``tiers.local`` then the remote tier: a stored entry that ``store.entry.problem`` finds
   sound is loaded onto the device and kept in memory. Nothing is written, nothing waited
   for: an unsound entry is only a miss here.
5. ``cache.flight``: the key's single flight (thread, then file, then fleet lock). Inside
   it, look again (someone may have built it meanwhile); an unsound entry is quarantined
   (that row, not whatever the key holds by then) and rebuilt from its engine and knobs on
   a replayed graph; otherwise ``autotuning.autotune`` picks a plan, which is stored.

A busy, full, read-only or damaged store turns into misses and unpersisted plans, never
into a failure: the caller gets a working plan, or a clear error about their own input.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, overload

from ..autotuning.autotune import TimingPolicy
from ..config import (
    APP,
    AUTO_PRIME,
    MAX_SIZE,
    MEMORY_PLANS,
    RECORD,
    REDIS_URL,
    ConfigError,
    argument,
    instance_of,
    switch,
    whole_number,
)
from ..config import tag as config_tag
from ..errors import PlanCacheError
from ..guest.backend import Backend, Load
from ..guest.tensors import TensorLike
from ..key import BuildOptions, CacheKey
from ..runtime.plan import Plan
from ..store import Store
from ..store.per_process import PerProcess
from ..tiers.local import LocalTier
from ..tiers.memory import LRU
from .builder import plan_builder
from .counters import Count, Counters
from .flight import SingleFlight, lock_timeout_of
from .lookup import Lookup
from .priming import Primer, app_name
from .recording import recorder_from_env

if TYPE_CHECKING:
    from ..tiers.remote import RemoteTier

__all__ = ["PlanCache"]

log = logging.getLogger("plancache")
F = TypeVar("F", bound=Callable[..., object])
D = TypeVar("D", BuildOptions, None)


def _default_backend() -> Backend:
    from ..cudnn.backend import CudnnBackend  # the only cuDNN import, and only when used

    return CudnnBackend()


def _options_of(options: object, default: D, where: str) -> BuildOptions | D:
    """``options=`` of the constructor, ``get`` or ``builder``: a ``BuildOptions``, or None
    for ``default``."""
    if options is None:
        return default
    checked: BuildOptions = argument(where, options, instance_of(BuildOptions, "pass BuildOptions(policy=..., top_k=...)"))
    return checked


def _tag_of(tag: object) -> str | None:
    return None if tag is None else argument("tag", tag, config_tag)  # describe() raised a bare TypeError


def _keys_of(keys: object) -> list[str]:
    """``preload(keys=)``: keys, each text. A key alone is text too, whose characters are no
    keys (each would be reported missing)."""
    listed = None if isinstance(keys, (str, bytes)) else list(keys) if isinstance(keys, Iterable) else None
    if listed is None or not all(isinstance(k, str) for k in listed):
        raise ConfigError(f"preload(keys={keys!r:.80}) is not a list of keys: pass preload([key, ...])", name="keys", value=keys)
    return listed


#: A device index, as ``key(device=)`` takes one.
_DEVICE = whole_number(0, "a device index")
#: What a backend must have: an instance, not its class or its name.
_BACKEND_METHODS = ("environment", "current_device", "plans", "load")


def _backend_of(backend: object) -> None:
    hint = "pass an instance, such as backend=plancache.testing.CpuTestBackend(), or leave it out for cuDNN"
    if isinstance(backend, (type, str)) or not all(callable(getattr(backend, m, None)) for m in _BACKEND_METHODS):
        what = "a class" if isinstance(backend, type) else "text" if isinstance(backend, str) else f"a {type(backend).__name__}"
        raise ConfigError(f"PlanCache(backend={backend!r}) is {what}, not a backend instance: {hint}", name="backend",
                          value=backend)  # fmt: skip


def _remote_from_env() -> RemoteTier | None:
    """The Redis tier when ``PLANCACHE_REDIS_URL`` is set (redis is imported only then)."""
    if REDIS_URL.from_env() is None:
        return None
    from ..tiers.remote import RemoteTier

    return RemoteTier.from_env()


class PlanCache:
    """A persistent plan cache in one directory.

    ``PlanCache()`` uses ``$PLANCACHE_DIR`` (else the user cache directory) and the cuDNN
    backend. ``cache.get(graph)`` returns a ready ``Plan`` for a ``cudnn.pygraph`` whose
    input and output tensors have uids; it replaces validate, build_operation_graph,
    create_execution_plans, check_support and build_plans.

    Thread-safe, and usable from any device: create it once (at import, say) and look up
    graphs on whichever device is current; each device gets plans keyed and loaded for it.

    ``options``: the default ``BuildOptions``. ``timing``: how candidates are timed.
    ``read_only``: serve hits, keep new plans in memory (default: detected). ``max_size``:
    bytes of plans kept on disk, least recently used evicted (``PLANCACHE_MAX_SIZE``).
    ``max_plans``: loaded plans kept in memory (``PLANCACHE_MEMORY_PLANS``, default 1024).
    ``lock_timeout``: seconds to wait for another thread, process or machine building the
    same plan (above 0; ``math.inf`` waits as long as the build takes).
    ``persist_kernel_cache``: store the shared kernel cache of dynamic-shape builds (off: it
    did not shorten builds on cuDNN 9.19). ``remote``: a ``RemoteTier``
    (default: from ``PLANCACHE_REDIS_URL``, else none). ``auto_prime``: on opening, load the
    plans this application's latest run used, on background threads (``PLANCACHE_AUTO_PRIME``,
    default on; see ``priming``). Which plans a run uses is recorded either way, under
    ``app`` (``PLANCACHE_APP``, else the entry script).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        backend: Backend | None = None,
        options: BuildOptions | None = None,
        timing: TimingPolicy | None = None,
        read_only: bool | None = None,
        max_size: int | None = None,
        max_plans: int | None = None,
        lock_timeout: float = 900.0,
        persist_kernel_cache: bool = False,
        remote: RemoteTier | None = None,
        auto_prime: bool | None = None,
        app: str | None = None,
    ) -> None:
        # Every argument read before anything is opened: a bad one is refused here, naming it.
        lock_timeout = lock_timeout_of(lock_timeout)
        read_only = None if read_only is None else argument("PlanCache(read_only)", read_only, switch)
        persist_kernel_cache = argument("PlanCache(persist_kernel_cache)", persist_kernel_cache, switch)
        if backend is not None:
            _backend_of(backend)
        options = _options_of(options, None, "PlanCache(options)")
        if timing is not None:
            argument("PlanCache(timing)", timing, instance_of(TimingPolicy, "pass TimingPolicy(runs=..., budget=...)"))
        self.max_size = MAX_SIZE.given_or_env(max_size, "max_size")
        auto_prime = AUTO_PRIME.given_or_env(auto_prime, "auto_prime")
        RECORD.from_env()  # a bad PLANCACHE_RECORD too (recorder_from_env reads it again below)
        self.counters = Counters()
        self._warned: set[str] = set()
        self.backend = backend if backend is not None else _default_backend()
        self.options = options or BuildOptions()
        self.timing = timing or TimingPolicy()
        self.local = LocalTier(directory, read_only=read_only, max_bytes=self.max_size, warn=self._warn_once,
                               store_error=lambda: self.counters.count(Count.STORE_ERRORS),
                               app=APP.of(app, "app") or app_name())  # fmt: skip
        self.directory = self.local.directory
        self.remote = remote if remote is not None else _remote_from_env()
        self.flight = SingleFlight(_lock_directory(self.local), timeout=lock_timeout, remote=self.remote, warn=self._warn_once,
                                   modes=self.local.modes,
                                   count=self.counters.count)  # fmt: skip
        self.lock_timeout = lock_timeout
        self.persist_kernel_cache = persist_kernel_cache
        self.lookup = Lookup(backend=self.backend, timing=self.timing, local=self.local, flight=self.flight, remote=self.remote,
                             counters=self.counters, warn=self._warn_once, max_plans=MEMORY_PLANS.given_or_env(max_plans, "max_plans"),
                             persist_kernel_cache=persist_kernel_cache)  # fmt: skip
        self._remote_flushed: dict[str, int] = {}
        recorder_from_env(self.add_recorder)  # PLANCACHE_RECORD=path: record every graph into a manifest
        if self.local.available and self.local.read_only:
            self._warn_once(
                "read-only", "plancache: %s is read-only: stored plans are served, new ones stay in memory", self.directory
            )
        _watch_process(self)
        self._primer: PerProcess[Primer | None] = PerProcess(lambda: None)  # a thread: a forked child has none
        if auto_prime and self.local.available:
            self.primer = Primer(self.lookup)
            self.primer.start()
        if self.local.available:
            _beside(self.lookup.prepare, self.options)

    # ------------------------------------------------------------------ public

    @property
    def closed(self) -> bool:
        return self.lookup.closed

    @property
    def primer(self) -> Primer | None:
        """The auto-prime thread of this cache (None when off or without a store, and in a
        forked child: threads do not survive a fork)."""
        return self._primer.get()

    @primer.setter
    def primer(self, primer: Primer | None) -> None:
        self._primer.set(primer)

    @property
    def memory(self) -> LRU[tuple[str, int], Plan]:
        """The memory tier: loaded plans by ``(key, device)``."""
        return self.lookup.memory

    def check_open(self) -> None:
        """Raise ``PlanCacheError`` once the cache is closed: it serves no plan after that,
        not even one a builder remembers."""
        if self.lookup.closed:
            raise PlanCacheError(f"the plan cache in {self.directory} is closed", path=str(self.directory))

    @property
    def store(self) -> Store | None:
        """The SQLite ``Store`` of this cache (None when it could not be opened)."""
        return self.local.store

    @property
    def environment(self) -> dict[str, object]:
        """The environment fingerprint of the calling thread's current device."""
        return self.environment_of(self.backend.current_device())

    def environment_of(self, device: int) -> dict[str, object]:
        """The environment fingerprint of ``device``."""
        return dict(self.lookup.environment(device)[0])

    def key(self, graph: object, options: BuildOptions | None = None, *, device: int | None = None,
            tag: str | None = None) -> CacheKey:  # fmt: skip
        """The key ``graph`` is stored under on ``device`` (default: the current one), with
        ``tag`` as ``get`` takes it; ``key.explain()`` shows each part."""
        options = _options_of(options, self.options, "key(options)")
        device = self.backend.current_device() if device is None else argument("key(device)", device, _DEVICE)
        return self.lookup.key(graph, options, device, _tag_of(tag))

    def get(self, graph: object, *, options: BuildOptions | None = None, inputs: Mapping[int, TensorLike] | None = None,
            load: Load | None = None, tag: str | None = None) -> Plan:  # fmt: skip
        """A ready plan for ``graph`` on the current device: from memory, from the store,
        from the fleet, or autotuned now. The plan takes the names of ``graph``.

        ``inputs`` (tensors by uid) are used to time candidates on a miss instead of
        random tensors. ``load`` (``(blob, tensors, device) -> native``): how this lookup
        loads a stored plan instead of the backend's ``load`` (the frontend drop-in loads
        it straight into the caller's graph); a plan built here is stored only once it was
        loaded back that way. ``tag``: stands for the callables the graph holds (an
        attention ``score_mod``), which cannot be keyed; it must change whenever what they
        do changes (docs/key.md). Raises ``InvalidGraphError`` for a graph that cannot be
        keyed or built, ``BuildError`` when no candidate builds on this GPU.
        """
        self.check_open()
        return self.lookup.get(graph, _options_of(options, self.options, "get(options)"), inputs, load, _tag_of(tag))

    def tune(self, graph: object, *, options: BuildOptions | None = None, tag: str | None = None) -> Plan:
        """Autotune ``graph`` again with no time budget and store the choice in place of its
        entry (``plancache tune`` calls it for entries whose miss stopped at the budget,
        ``PLANCACHE_AUTOTUNE_BUDGET``). Later lookups of other processes get the new plan.
        ``tag`` as ``get`` takes it. Raises as ``get`` does."""
        self.check_open()
        options = _options_of(options, self.options, "tune(options)")
        device = self.backend.current_device()
        key, names = self.lookup.key_and_names(graph, options, device, _tag_of(tag))
        return self.lookup.retune(graph, key, options, device).named(names)

    @overload
    def builder(self, fn: F, *, options: BuildOptions | None = None, key: Callable[..., Hashable] | None = None,
                tag: str | None = None) -> Callable[..., Plan]: ...  # fmt: skip
    @overload
    def builder(self, fn: None = None, *, options: BuildOptions | None = None, key: Callable[..., Hashable] | None = None,
                tag: str | None = None) -> Callable[[F], Callable[..., Plan]]: ...  # fmt: skip
    def builder(self, fn: F | None = None, *, options: BuildOptions | None = None, key: Callable[..., Hashable] | None = None,
                tag: str | None = None) -> Callable[..., Plan] | Callable[[F], Callable[..., Plan]]:  # fmt: skip
        """Decorate a function that builds a ``cudnn.pygraph`` from its arguments.

        The decorated function returns a ``Plan``. Calls whose arguments are keyed alike
        return the same plan without building the graph again: a repeat costs a few
        microseconds. Arguments are keyed as ``describe`` keys graphs: tensors by shape,
        strides, dtype and device; numbers to the bit and by type (``0``, ``0.0`` and
        ``-0.0`` differ); containers by content; enums, dtypes, frozen dataclasses and
        named tuples by value. Any other object raises ``UnkeyableArgumentError``: pass
        ``key=``. The plans it remembers are bounded like the memory tier (least recently
        used dropped).

        ``key``: a function of the same arguments returning what the graph depends on
        (``key=lambda x, w: x.shape[0]``, say). It replaces the automatic signature,
        which makes repeats cheaper; it must capture everything that changes the graph,
        the device included when that varies. ``tag``: passed to ``get`` for every graph
        built (graphs holding a ``score_mod``); callable arguments are then keyed by
        identity.
        """
        options, tag = _options_of(options, None, "builder(options)"), _tag_of(tag)
        if key is not None and not callable(key):
            raise ConfigError(f"builder(key={key!r}) is not a function of the builder's arguments", name="key", value=key)
        if fn is not None:
            return plan_builder(self, fn, options, key, tag)
        return lambda func: plan_builder(self, func, options, key, tag)

    def preload(self, keys: Iterable[str] | None = None) -> dict[str, object]:
        """Load stored plans of the current device into memory before the first step, so
        later ``get`` calls find them without touching the store or cuDNN's deserializer.

        ``keys``: the keys to load (from a manifest, say); None loads every entry of this
        device's environment. Unsound entries are quarantined and reported, never raised.
        Returns ``{"loaded": [...], "missing": [...], "failed": {key: reason}, "seconds": s}``.
        """
        self.check_open()
        device = self.backend.current_device()
        keys = self.local.entries_of(self.lookup.environment(device)[1]) if keys is None else _keys_of(keys)
        return self.lookup.preload(keys, device)

    def stats(self) -> dict[str, object]:
        """This process's counters, the store's totals, and the remote tier's counters;
        ``native_fallbacks``: plans loaded through the frontend's path instead of cuDNN's C
        API (with the reasons); ``unstored_plans``: the plans this process built but did not
        store (key -> graph, why: ``unloadable`` or ``judge_disagreements``, and the reason);
        ``judge_disagreement``: the first reason the judge gave for refusing a plan just built
        (None: it refused none)."""
        fallbacks = dict(getattr(self.backend, "native_fallbacks", None) or {})
        data: dict[str, object] = {"process": {**self.counters, "memory_plans": len(self.memory), "memory_evicted": self.memory.evicted,
                                            "native_fallbacks": sum(fallbacks.values()), "native_fallback_reasons": fallbacks},
                                "store": self.local.stats()}  # fmt: skip
        data["unstored_plans"] = self.lookup.unstored.report()
        data["judge_disagreement"] = self.lookup.unstored.first_disagreement
        if self.remote is not None:
            data["remote"] = self.remote.stats()
        return data

    def flush(self) -> None:
        """Write batched hit counts (and the remote tier's counters) now, waiting for the
        store if it is busy; the background writer and ``close`` never wait."""
        self.local.flush(wait=True)
        self.local.bump_counters(self._remote_counter_deltas(), wait=True)

    def close(self) -> None:
        """Write what is pending (without waiting on a busy store) and close the store and
        the remote tier. Later lookups raise ``PlanCacheError``."""
        if self.lookup.closed:
            return
        self.lookup.closed = True
        if self.primer is not None:
            self.primer.stop()  # not inside cuDNN once the cache is closed
        self.local.bump_counters(self._remote_counter_deltas(), wait=False)
        self.local.close()
        if self.remote is not None:
            self.remote.close()

    def __enter__(self) -> PlanCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_recorder(self, record: Callable[[object, CacheKey], None]) -> None:
        """Call ``record(graph, key)`` for every graph looked up (used to write manifests)."""
        self.lookup.recorders.append(record)

    # ------------------------------------------------------------------ bookkeeping

    def _warn_once(self, topic: str, message: str, *args: object) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            log.warning(message, *args)

    def _remote_counter_deltas(self) -> dict[str, int]:
        """Remote counters since the last flush, named for the store (``remote_refused``...)."""
        if self.remote is None:
            return {}
        now = {k: v for k, v in self.remote.stats().items() if isinstance(v, int) and not isinstance(v, bool)}
        deltas = {}
        for name, value in now.items():
            stored = name if name.startswith("remote_") else f"remote_{name}"
            deltas[stored] = value - self._remote_flushed.get(name, 0)
        self._remote_flushed = now
        return deltas


def _lock_directory(local: LocalTier) -> Path | None:
    """Where the build locks go: ``locks/`` of a writable cache directory. They need only the
    directory, not a working store: processes that cannot store plans must still not
    autotune the same key at once."""
    writable = (
        local.refused is None and os.access(local.directory, os.W_OK) and not (local.store is not None and local.store.read_only)
    )
    return local.directory / "locks" if writable else None


def _beside(work: Callable[..., None], *args: object) -> None:
    """Run ``work(*args)`` on a daemon thread beside the program. Where no thread can be
    started (a limit on threads), nothing is lost: the first lookup does that work."""
    with contextlib.suppress(RuntimeError):
        threading.Thread(target=work, args=args, name="plancache-prepare", daemon=True).start()


def _watch_process(cache: PlanCache) -> None:
    """Flush the cache's batched hit counts when the process ends (a forked child's own:
    what the cache keeps per process is the child's there); weakly, so the cache can be freed."""
    import atexit

    atexit.register(functools.partial(_flush_at_exit, weakref.ref(cache)))


def _flush_at_exit(ref: weakref.ref[PlanCache]) -> None:
    cache = ref()
    if cache is not None and not cache.closed:
        if cache.primer is not None:
            cache.primer.stop(timeout=5.0)  # silent at exit: never inside cuDNN while the interpreter goes down
        cache.local.flush(wait=False)
