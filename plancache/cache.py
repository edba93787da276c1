"""PlanCache: key -> hit (verify, deserialize) or miss (autotune, serialize, store).

Lookups never block on other processes and never write. A miss takes a per-key file lock
so that many processes missing the same key autotune it once; the others wait (bounded)
and load what the first one stored. Anything that goes wrong with the store (busy, full,
read-only, damaged) is logged, counted and turns into a miss or an unpersisted plan: the
caller always gets a working plan or a clear error about their own input.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import sqlite3
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .autotune import TimingPolicy, autotune
from .backend import Backend, BuiltPlan, EngineChoice
from .errors import DamagedEntryError, LockTimeoutError, StoreError
from .key import BuildOptions, CacheKey, TensorSpec, describe, environment_id, make_key
from .plan import Plan
from .store import Entry, Store, StoredPlan, entry_problem, sha256

__all__ = ["PlanCache", "summarize"]

log = logging.getLogger("plancache")
F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

_HIT_FLUSH_EVERY = 512  # batched hit-count writes: at most one per this many hits, and at close
_COUNTERS = ("memory_hits", "hits", "misses", "builds", "rebuilds", "corrupt", "refused", "store_errors",
             "waits", "unpersisted", "kernel_cache_restores")  # fmt: skip


def summarize(description: Mapping[str, Any]) -> str:
    """A short op summary of a canonical description: ``CONV_FPROP+POINTWISE(relu)``."""
    parts = []
    for node in description.get("nodes", []):
        mode = node.get("params", {}).get("mode") if isinstance(node.get("params"), dict) else None
        parts.append(f"{node['type']}({mode})" if mode else str(node["type"]))
    return "+".join(parts)


def _default_backend() -> Backend:
    from .cudnn_backend import CudnnBackend  # the only cuDNN import, and only when used

    return CudnnBackend()


def _remote_from_env() -> Any:
    """The Redis tier when ``PLANCACHE_REDIS_URL`` is set (redis is imported only then)."""
    if not os.environ.get("PLANCACHE_REDIS_URL", "").strip():
        return None
    from .remote import RemoteTier

    return RemoteTier.from_env()


def _max_size_from_env() -> int | None:
    from .config import max_size_from_env  # PLANCACHE_MAX_SIZE: 0 is no limit, a bad value a ConfigError

    return max_size_from_env()


class PlanCache:
    """A persistent plan cache in one directory.

    ``PlanCache()`` uses ``$PLANCACHE_DIR`` (else the user cache directory) and the cuDNN
    backend. ``cache.get(graph)`` returns a ready ``Plan`` for a ``cudnn.pygraph`` whose
    input and output tensors have uids; it replaces validate, build_operation_graph,
    create_execution_plans, check_support and build_plans.

    Thread-safe. One instance per process is the intended use; several are fine.

    ``options``: the default ``BuildOptions`` (autotune policy, K, heuristic modes,
    workspace limit, kernel-cache sharing). ``timing``: how candidates are timed.
    ``read_only``: serve hits, keep new plans in memory (default: detected).
    ``max_size``: bytes of plans kept, least recently used evicted (``PLANCACHE_MAX_SIZE``).
    ``lock_timeout``: seconds to wait for another process building the same plan.
    ``persist_kernel_cache``: store the shared kernel cache of dynamic-shape builds and
    restore it in later processes (off: it did not shorten builds on cuDNN 9.19).
    ``remote``: a ``RemoteTier`` (default: from ``PLANCACHE_REDIS_URL``, else none).
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
        lock_timeout: float = 900.0,
        persist_kernel_cache: bool = False,
        remote: Any = None,
    ) -> None:
        self.backend = backend if backend is not None else _default_backend()
        self.options = options or BuildOptions()
        self.timing = timing or TimingPolicy()
        self.store = Store(directory, read_only=read_only)
        self.directory = self.store.directory
        self.max_size = max_size if max_size is not None else _max_size_from_env()
        self.lock_timeout = lock_timeout
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._memory: dict[tuple[str, int], Plan] = {}
        self._pending_hits: dict[str, tuple[int, float]] = {}
        self._pending_total = 0
        self._lock = threading.RLock()
        self._environment: dict[str, Any] | None = None
        self._warned: set[str] = set()
        self._recorders: list[Callable[[Any, CacheKey], None]] = []
        from .manifest import recorder_from_env  # PLANCACHE_RECORD=path: record every graph into a manifest

        recorder_from_env(self)
        self.persist_kernel_cache = persist_kernel_cache
        self.remote = remote if remote is not None else _remote_from_env()
        self._remote_flushed: dict[str, int] = {}
        self._kernel_cache_restored = False
        self._kernel_cache_digest: str | None = None
        if self.store.read_only:
            self._warn_once("read-only", "plancache: %s is read-only: stored plans are served, new ones stay in memory", self.directory)
        # Flush batched hit counts when the process ends; weakly, so the cache can be freed.
        atexit.register(_flush_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ public

    @property
    def environment(self) -> dict[str, Any]:
        """The environment fingerprint of this process's current device."""
        if self._environment is None:
            self._environment = self.backend.environment()
        return self._environment

    def key(self, graph: Any, options: BuildOptions | None = None) -> CacheKey:
        """The key ``graph`` is stored under; ``key.explain()`` shows each part."""
        return make_key(describe(graph), self.environment, options or self.options)

    def get(self, graph: Any, *, options: BuildOptions | None = None, inputs: Mapping[int, Any] | None = None) -> Plan:
        """A ready plan for ``graph``: from memory, from the store, or autotuned now.

        ``inputs`` (tensors by uid) are used to time candidates on a miss instead of
        random tensors. Raises ``InvalidGraphError`` for a graph that cannot be keyed or
        built, ``BuildError`` when no candidate builds on this GPU.
        """
        options = options or self.options
        key = make_key(describe(graph), self.environment, options)
        for record in self._recorders:
            record(graph, key)
        memo = (key.digest, self.backend.current_device())
        plan = self._memory.get(memo)
        if plan is not None:
            self.counters["memory_hits"] += 1
            self._note_hit(key.digest)  # so a long-lived process keeps its plans young for eviction
            return plan
        with self._lock:
            plan = self._memory.get(memo)
            if plan is None:
                plan = self._lookup_or_build(graph, key, options, inputs)
                self._memory[memo] = plan
        return plan

    def builder(
        self, fn: F | None = None, *, options: BuildOptions | None = None, key: Callable[..., Any] | None = None
    ) -> Any:
        """Decorate a function that builds a ``cudnn.pygraph`` from its arguments.

        The decorated function returns a ``Plan``. Calls with arguments of the same
        shapes, strides, dtypes and devices (tensors) and equal values (anything else)
        return the same plan without building the graph again: a repeat costs a few
        microseconds (reading four attributes of each tensor dominates). Non-tensor
        arguments must be hashable.

        ``key``: a function of the same arguments returning what the graph depends on
        (``key=lambda x, w: x.shape[0]``, say). It replaces the automatic signature,
        which makes repeats cheaper; it must capture everything that changes the graph,
        the device included when that varies.
        """

        def wrap(func: F) -> Callable[..., Plan]:
            plans: dict[Any, Plan] = {}

            @functools.wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Plan:
                if key is not None:
                    signature: Any = key(*args, **kwargs)
                else:
                    signature, has_tensor = _signature(args, kwargs)
                    if not has_tensor:
                        # No tensor argument tells the device: the plan belongs to the current one.
                        signature = (*signature, self.backend.current_device())
                plan = plans.get(signature)
                if plan is None:
                    plan = self.get(func(*args, **kwargs), options=options)
                    plans[signature] = plan
                else:
                    self.counters["memory_hits"] += 1
                return plan

            wrapper.plans = plans  # type: ignore[attr-defined]
            return wrapper

        return wrap(fn) if fn is not None else wrap

    def preload(self, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """Load stored plans into memory before the first step, so later ``get`` calls
        find them without touching the store or cuDNN's deserializer.

        ``keys``: the keys to load (from a manifest, say); None loads every entry of this
        environment. Damaged entries are quarantined and reported, never raised.
        Returns ``{"loaded": [...], "missing": [...], "failed": {key: reason}, "seconds": s}``.
        """
        started = time.perf_counter()
        env_id = environment_id(self.environment)
        if keys is None:
            keys = [row["key"] for row in self.store.list_entries(env_id)]
        device = self.backend.current_device()
        report: dict[str, Any] = {"loaded": [], "missing": [], "failed": {}}
        for digest in keys:
            if (digest, device) in self._memory:
                report["loaded"].append(digest)
                continue
            stored = self._read_plan(digest)
            if stored is None:
                report["missing"].append(digest)
                continue
            if stored.environment != self.environment:  # not damage: kept for its own machines
                report["failed"][digest] = "entry belongs to another environment"
                continue
            loaded = self._checked_load(digest, stored, self.environment, None)
            if isinstance(loaded, str):  # damaged or refused: reported, never raised
                self._quarantine(digest, loaded)
                report["failed"][digest] = loaded
                continue
            native, tensors = loaded
            engine = _engine_of(stored.engine)
            with self._lock:
                self._memory[(digest, device)] = self._plan(digest, native, tensors, stored.workspace_size, engine, "loaded")
            self.counters["hits"] += 1
            self._note_hit(digest)
            report["loaded"].append(digest)
        report["seconds"] = time.perf_counter() - started
        return report

    def stats(self) -> dict[str, Any]:
        """This process's counters, the store's totals, and the remote tier's counters."""
        data: dict[str, Any] = {"process": dict(self.counters), "store": self.store.stats()}
        if self.remote is not None:
            data["remote"] = self.remote.stats()
        return data

    def flush(self) -> None:
        """Write batched hit counts (and the remote tier's counters) now; also done at
        close and at exit."""
        with self._lock:
            pending, self._pending_hits, self._pending_total = self._pending_hits, {}, 0
            remote = self._remote_counter_deltas()
        if self.store.read_only or not (pending or remote):
            return
        try:
            self.store.record_hits(pending)
            self.store.bump_many(remote)
        except StoreError as exc:
            self._warn_once("hits", "plancache: could not record hit counts: %s", exc)

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

    def close(self) -> None:
        self.flush()
        self.store.close()
        if self.remote is not None:
            self.remote.close()

    def __enter__(self) -> PlanCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_recorder(self, record: Callable[[Any, CacheKey], None]) -> None:
        """Call ``record(graph, key)`` for every graph looked up (used to write manifests)."""
        self._recorders.append(record)

    # ------------------------------------------------------------------ internals

    def _warn_once(self, topic: str, message: str, *args: Any) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            log.warning(message, *args)

    def _note_hit(self, key: str) -> None:
        count, _ = self._pending_hits.get(key, (0, 0.0))
        self._pending_hits[key] = (count + 1, time.time())
        self._pending_total += 1
        if self._pending_total >= _HIT_FLUSH_EVERY:
            self.flush()

    def _read(self, key: str) -> Entry | None:
        """The whole entry under ``key``; the store's failures are misses."""
        return self._guarded_read(key, self.store.get)

    def _read_plan(self, key: str) -> StoredPlan | None:
        """What a hit needs of the entry under ``key``; the store's failures are misses."""
        return self._guarded_read(key, self.store.get_plan)

    def _guarded_read(self, key: str, read: Callable[[str], R | None]) -> R | None:
        try:
            return read(key)
        except DamagedEntryError as exc:  # one undecodable row: out of service, then a miss
            self._quarantine(key, f"entry cannot be decoded: {str(exc.__cause__ or exc)[:200]}")
            return None
        except (StoreError, sqlite3.Error, OSError) as exc:  # a damaged or busy store is a miss
            self.counters["store_errors"] += 1
            self._warn_once("read", "plancache: reading %s failed (%s); treating as a miss", self.store.path, exc)
            return None

    def _lookup_or_build(self, graph: Any, key: CacheKey, options: BuildOptions, inputs: Mapping[int, Any] | None) -> Plan:
        plan = self._load(graph, key, options) or self._from_remote(graph, key, options)
        if plan is not None:
            return plan
        if self.store.read_only:
            return self._build_once_in_fleet(graph, key, options, inputs, persist=False)
        try:
            lock = self._key_lock(key.digest)
            started = time.monotonic()
            lock.acquire(timeout=1.0)
        except TimeoutError:
            self.counters["waits"] += 1
            log.info("plancache: waiting up to %.0f s for another process to build %s (%s); lock %s",
                     self.lock_timeout, key.digest[:12], summarize(key.parts["graph"]), lock.lock_file)  # fmt: skip
            try:
                lock.acquire(timeout=max(0.0, self.lock_timeout - 1.0))
            except TimeoutError as exc:
                raise LockTimeoutError(
                    f"waited {time.monotonic() - started:.0f} s for another process to build plan {key.digest[:12]} "
                    f"(lock {lock.lock_file}); the lock goes when its holder exits, so that process is still "
                    "building or hung. Raise lock_timeout for very long autotuning",
                    key=key.digest,
                    waited_s=time.monotonic() - started,
                ) from exc
            log.info("plancache: waited %.1f s for %s", time.monotonic() - started, key.digest[:12])
        except OSError as exc:  # no lock file (disk full, odd permissions): still a plan, maybe built twice
            self.counters["store_errors"] += 1
            self._warn_once("lock", "plancache: cannot take the build lock in %s (%s); building without it", self.directory, exc)
            return self._build_once_in_fleet(graph, key, options, inputs, persist=True)
        try:
            plan = self._load(graph, key, options)  # built by the process we waited for?
            if plan is not None:
                return plan
            return self._build_once_in_fleet(graph, key, options, inputs, persist=True)
        finally:
            lock.release()

    def _build_once_in_fleet(
        self, graph: Any, key: CacheKey, options: BuildOptions, inputs: Mapping[int, Any] | None, *, persist: bool
    ) -> Plan:
        """Build, holding the fleet-wide Redis lock when there is a remote tier: a node that
        waited finds the plan another node published (inside its lock) and loads it."""
        if self.remote is None:
            return self._build(graph, key, options, inputs, persist=persist)
        env_id = environment_id(key.parts["environment"])
        with self.remote.lock(key.digest, env_id, wait=self.lock_timeout) as mine:
            if not mine:
                plan = self._from_remote(graph, key, options)
                if plan is not None:
                    return plan
            return self._build(graph, key, options, inputs, persist=persist)

    def _from_remote(self, graph: Any, key: CacheKey, options: BuildOptions) -> Plan | None:
        """Read-through: a verified remote entry is stored locally, then loaded as a hit."""
        if self.remote is None:
            return None
        entry = self.remote.get(key.digest, environment_id(key.parts["environment"]))
        if entry is None:
            return None
        if not self.store.read_only:
            try:
                self.store.put(entry)
            except (StoreError, OSError) as exc:
                self._warn_once("write", "plancache: could not store remote plan %s (%s); using it from memory", key.digest[:12], exc)
        return self._load(graph, key, options, entry=entry)

    def _key_lock(self, digest: str) -> Any:
        from filelock import FileLock  # imported on the first miss only

        locks = self.directory / "locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        return FileLock(str(locks / f"{digest[:32]}.lock"), mode=0o600)

    def _load(self, graph: Any, key: CacheKey, options: BuildOptions, entry: Entry | None = None) -> Plan | None:
        """A hit: check what the plan executes with, deserialize, or quarantine and rebuild.

        ``entry``: a whole entry from the remote tier, checked whole. Otherwise only what a
        hit needs is read (``Store.get_plan``): the lookup stays within a few hundred
        microseconds of cuDNN's own deserialize.
        """
        if entry is not None:
            stored: StoredPlan | None = _serving_view(entry)
        else:
            stored = self._read_plan(key.digest)
            if stored is None:
                return None
        assert stored is not None
        loaded = self._checked_load(key.digest, stored, key.parts["environment"], entry)
        if not isinstance(loaded, str):
            native, tensors = loaded
            self.counters["hits"] += 1
            self._note_hit(key.digest)
            engine = _engine_of(stored.engine)
            return self._plan(key.digest, native, _named_as(tensors, graph), stored.workspace_size, engine, "loaded")
        old = entry if entry is not None else self._read_quietly(key.digest)
        engine = _engine_of(stored.engine)
        self._quarantine(key.digest, loaded)
        if engine is None or self.store.read_only:
            return None
        return self._rebuild(graph, key, options, old, engine)

    def _checked_load(
        self, digest: str, stored: StoredPlan, environment: Mapping[str, Any], entry: Entry | None
    ) -> tuple[Any, list[TensorSpec]] | str:
        """Deserialize a stored plan once every check passed: ``(native, tensors)``, or why
        it must not be served. ``entry``: the whole entry, when the caller has it (remote)."""
        if entry is not None:
            reason = _unusable(entry, environment)
        else:
            reason = stored.problem(environment)
            if reason is None and stored.meta_ok is None:  # a schema-1 row: check it whole
                old = self._read(digest)
                reason = _unusable(old, environment) if old is not None else "entry cannot be read"
        if reason is not None:
            return reason
        try:
            tensors = [TensorSpec.from_dict(t) for t in stored.tensors]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # damaged, yet valid JSON
            return f"tensor table cannot be decoded: {exc!r}"
        try:
            return self.backend.load(stored.blob, tensors), tensors
        except Exception as exc:  # the library refusing a blob is a miss, never a crash
            return f"deserialize failed: {type(exc).__name__}: {exc}"

    def _read_quietly(self, key: str) -> Entry | None:
        """The whole entry for a rebuild's records (candidates, policy), if it still reads."""
        try:
            return self.store.get(key)
        except (StoreError, sqlite3.Error, OSError):
            return None

    def _quarantine(self, digest: str, reason: str) -> None:
        self.counters["corrupt"] += 1
        log.warning("plancache: entry %s is unusable (%s); quarantined, rebuilding", digest[:12], reason)
        if self.store.read_only:
            return
        try:
            self.store.quarantine(digest, reason)
        except StoreError as exc:
            self._warn_once("quarantine", "plancache: could not quarantine %s: %s", digest[:12], exc)

    def _rebuild(self, graph: Any, key: CacheKey, options: BuildOptions, old: Entry | None, engine: EngineChoice) -> Plan | None:
        """Rebuild a damaged entry from its engine id and knobs: no autotuning."""
        started = time.perf_counter()
        try:
            built = self.backend.rebuild(graph, engine, options)
        except Exception as exc:
            log.warning("plancache: rebuilding %s from engine %s failed (%s); autotuning instead", key.digest[:12], engine.name, exc)
            return None
        self.counters["rebuilds"] += 1
        # The damaged entry's autotuning record still says why this engine was chosen.
        policy = old.policy if old is not None else options.policy
        candidates = old.candidates if old is not None else []
        timing = old.timing if old is not None else {"method": "rebuilt from the stored engine id and knobs"}
        self._persist(key, built, policy, candidates, timing, time.perf_counter() - started, 0.0)
        return self._plan(key.digest, built.native, built.tensors, built.workspace_size, built.engine, "rebuilt")

    def _build(
        self, graph: Any, key: CacheKey, options: BuildOptions, inputs: Mapping[int, Any] | None, *, persist: bool
    ) -> Plan:
        self.counters["misses"] += 1
        started = time.perf_counter()
        dynamic = bool(key.parts["graph"].get("flags", {}).get("dynamic_shape"))
        if dynamic:
            self._restore_kernel_cache(key)  # only with persist_kernel_cache
        cands = self.backend.candidates(graph, options, inputs)
        try:
            result = autotune(cands, options, self.timing)
            built = cands.finish(result.winner)
        finally:
            cands.close()
        self.counters["builds"] += 1
        if dynamic and persist and self.persist_kernel_cache:
            self._save_kernel_cache(key)
        elapsed = time.perf_counter() - started
        reports = [r.to_dict() for r in result.candidates]
        if persist:
            self._persist(key, built, result.policy, reports, result.timing, elapsed, result.autotune_seconds)
        else:
            self.counters["unpersisted"] += 1
        return self._plan(key.digest, built.native, built.tensors, built.workspace_size, built.engine, "built")

    def _restore_kernel_cache(self, key: CacheKey) -> None:
        """Before this process's first dynamic-shape build: load the stored kernel cache of
        this environment (never another's: it is stored under the environment id)."""
        if self._kernel_cache_restored or not self.persist_kernel_cache:
            return
        self._kernel_cache_restored = True
        restore = getattr(self.backend, "restore_kernel_cache", None)
        if restore is None:
            return
        try:
            stored = self.store.get_kernel_cache(environment_id(key.parts["environment"]))
        except (StoreError, sqlite3.Error) as exc:
            self._warn_once("kernel-cache", "plancache: cannot read the stored kernel cache: %s", exc)
            return
        if stored is None:
            return
        try:
            restore(stored[0])
        except Exception as exc:  # a refused kernel cache only costs compile time
            self._warn_once("kernel-cache", "plancache: the stored kernel cache was refused (%s); building without it", exc)
            return
        self._kernel_cache_digest = sha256(stored[0])
        self.counters["kernel_cache_restores"] += 1

    def _save_kernel_cache(self, key: CacheKey) -> None:
        """After a dynamic-shape build: store the kernel cache if it changed."""
        blob_of = getattr(self.backend, "kernel_cache_blob", None)
        blob = blob_of() if blob_of is not None else None
        if not blob or sha256(blob) == self._kernel_cache_digest:
            return
        try:
            self.store.put_kernel_cache(environment_id(key.parts["environment"]), blob, None)
        except (StoreError, sqlite3.Error) as exc:
            self._warn_once("kernel-cache-write", "plancache: cannot store the kernel cache: %s", exc)
            return
        self._kernel_cache_digest = sha256(blob)

    def _persist(
        self,
        key: CacheKey,
        built: BuiltPlan,
        policy: str,
        candidates: list[dict[str, Any]],
        timing: dict[str, Any],
        build_seconds: float,
        autotune_seconds: float,
    ) -> None:
        now = time.time()
        entry = Entry(
            key=key.digest,
            env_id=environment_id(key.parts["environment"]),
            label=summarize(key.parts["graph"]),
            description=key.parts["graph"],
            environment=key.parts["environment"],
            options=key.parts["options"],
            tensors=[t.to_dict() for t in built.tensors],
            blob=built.blob,
            blob_sha256=sha256(built.blob),
            engine=built.engine.to_dict() if built.engine else None,
            workspace_size=built.workspace_size,
            policy=policy,
            candidates=candidates,
            timing=timing,
            build_seconds=build_seconds,
            autotune_seconds=autotune_seconds,
            backend=self.backend.name,
            created_at=now,
            last_used_at=now,
        )
        try:
            self.store.put(entry)
            if self.max_size is not None:
                self.store.evict_to(self.max_size)
        except (StoreError, OSError, sqlite3.Error) as exc:  # disk full, read-only, damaged: the plan still works
            self.counters["store_errors"] += 1
            self.counters["unpersisted"] += 1
            self._warn_once("write", "plancache: could not store plan %s (%s); it is used from memory only", key.digest[:12], exc)
        if self.remote is not None:
            self.remote.put(entry)  # inside the fleet lock: nodes waiting on it find the plan

    def _plan(self, digest: str, native: Any, tensors: list[TensorSpec], workspace: int, engine: EngineChoice | None, source: str) -> Plan:
        return Plan(
            key=digest,
            backend=self.backend,
            native=native,
            tensors=tensors,
            workspace_size=workspace,
            engine=engine,
            source=source,
            device=self.backend.current_device(),
        )


_tensor_type: Any = None
_KWARGS = object()


def _flush_at_exit(ref: weakref.ref[PlanCache]) -> None:
    cache = ref()
    if cache is not None:
        cache.flush()


def _unusable(entry: Entry, environment: Mapping[str, Any]) -> str | None:
    """Why a stored entry must not be served for a key of ``environment``, or None."""
    if entry.environment != environment:
        return "environment differs from the key's"
    if not entry.checksum_ok():
        return "blob checksum mismatch"
    return entry_problem(entry)  # the row's own metadata altered (key, environment id, inputs)


def _serving_view(entry: Entry) -> StoredPlan:
    return StoredPlan(entry.key, entry.environment, entry.tensors, entry.blob, entry.blob_sha256, entry.engine,
                      entry.workspace_size, None if entry.meta_sha256 is None else entry.meta_sha256 == entry.meta_digest())  # fmt: skip


def _engine_of(engine: Mapping[str, Any] | None) -> EngineChoice | None:
    """The recorded engine and knobs, or None when absent or damaged (then: autotune)."""
    try:
        return EngineChoice.from_dict(engine) if engine else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _named_as(tensors: list[TensorSpec], graph: Any) -> list[TensorSpec]:
    """The stored tensor table under the names of the caller's graph: names are not part
    of the key, so a plan stored by one caller is found by another that named differently."""
    tensor_map = getattr(graph, "tensors", None)
    if not isinstance(tensor_map, Mapping):
        return tensors
    names = {int(t.uid): str(name) for name, t in tensor_map.items() if not t.is_virtual}
    return [t if names.get(t.uid, t.name) == t.name else dataclasses.replace(t, name=names[t.uid]) for t in tensors]


def _signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], bool]:
    """What a builder's result depends on: tensors by layout (shape, strides, dtype,
    device), everything else by value; and whether any argument was a tensor.

    On the hot path of every decorated call, hence the plain loops and no helper calls.
    """
    global _tensor_type
    tensor_type = _tensor_type
    if tensor_type is None:
        torch = sys.modules.get("torch")
        tensor_type = () if torch is None else torch.Tensor
        if torch is not None:
            _tensor_type = tensor_type  # resolved once torch is loaded
    has_tensor = False
    signature: list[Any] = []
    for a in args:
        if isinstance(a, tensor_type):
            signature.append((a.shape, a.stride(), a.dtype, a.device))
            has_tensor = True
        else:
            signature.append(a)
    if kwargs:
        signature.append(_KWARGS)  # f(("n", 1)) and f(n=1) must not look alike
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, tensor_type):
                signature.append((name, (value.shape, value.stride(), value.dtype, value.device)))
                has_tensor = True
            else:
                signature.append((name, value))
    return tuple(signature), has_tensor
