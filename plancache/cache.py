"""PlanCache: key -> hit (verify, deserialize) or miss (autotune, serialize, store).

Lookups never block on other processes and never write. A miss takes a per-key file lock
so that many processes missing the same key autotune it once; the others wait (bounded)
and load what the first one stored. Anything that goes wrong with the store (busy, full,
read-only, damaged) is logged, counted and turns into a miss or an unpersisted plan: the
caller always gets a working plan or a clear error about their own input.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .autotune import TimingPolicy, autotune
from .backend import Backend, BuiltPlan, EngineChoice
from .errors import LockTimeoutError, StoreError
from .key import BuildOptions, CacheKey, TensorSpec, describe, environment_id, make_key
from .plan import Plan
from .store import Entry, Store, sha256

__all__ = ["PlanCache", "summarize"]

log = logging.getLogger("plancache")
F = TypeVar("F", bound=Callable[..., Any])

_HIT_FLUSH_EVERY = 512  # batched hit-count writes: at most one per this many hits, and at close
_COUNTERS = ("memory_hits", "hits", "misses", "builds", "rebuilds", "corrupt", "refused", "store_errors",
             "waits", "unpersisted")  # fmt: skip


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


def _max_size_from_env() -> int | None:
    text = os.environ.get("PLANCACHE_MAX_SIZE", "").strip()
    if not text:
        return None
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    scale = units.get(text[-1].lower(), 1)
    number = text[:-1] if text[-1].lower() in units else text
    try:
        return int(float(number) * scale)
    except ValueError as exc:
        raise ValueError(f"PLANCACHE_MAX_SIZE={text!r} is not a size like 500M or 2G") from exc


class PlanCache:
    """A persistent plan cache in one directory.

    ``PlanCache()`` uses ``$PLANCACHE_DIR`` (else the user cache directory) and the cuDNN
    backend. ``cache.get(graph)`` returns a ready ``Plan`` for a ``cudnn.pygraph`` whose
    input and output tensors have uids; it replaces validate, build_operation_graph,
    create_execution_plans, check_support and build_plans.

    Thread-safe. One instance per process is the intended use; several are fine.
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
        self._lock = threading.RLock()
        self._environment: dict[str, Any] | None = None
        self._warned: set[str] = set()
        self._recorders: list[Callable[[Any, CacheKey], None]] = []
        if self.store.read_only:
            self._warn_once("read-only", "plancache: %s is read-only: stored plans are served, new ones stay in memory", self.directory)
        # Flush batched hit counts when the process ends; weakly, so the cache can be freed.
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c.flush())

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
            return plan
        with self._lock:
            plan = self._memory.get(memo)
            if plan is None:
                plan = self._lookup_or_build(graph, key, options, inputs)
                self._memory[memo] = plan
        return plan

    def builder(self, fn: F | None = None, *, options: BuildOptions | None = None) -> Any:
        """Decorate a function that builds a ``cudnn.pygraph`` from its arguments.

        The decorated function returns a ``Plan``. Calls with arguments of the same
        shapes, strides, dtypes and devices (tensors) and equal values (anything else)
        return the same plan without building the graph again: a repeat costs
        microseconds. Non-tensor arguments must be hashable.
        """

        def wrap(func: F) -> Callable[..., Plan]:
            plans: dict[Any, Plan] = {}

            @functools.wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Plan:
                signature = _signature(args, kwargs)
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

    def stats(self) -> dict[str, Any]:
        """This process's counters, then the store's totals."""
        return {"process": dict(self.counters), "store": self.store.stats()}

    def flush(self) -> None:
        """Write batched hit counts now (also done at close and at exit)."""
        with self._lock:
            pending, self._pending_hits = self._pending_hits, {}
        if pending and not self.store.read_only:
            try:
                self.store.record_hits(pending)
            except StoreError as exc:
                self._warn_once("hits", "plancache: could not record hit counts: %s", exc)

    def close(self) -> None:
        self.flush()
        self.store.close()

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
        if sum(c for c, _ in self._pending_hits.values()) >= _HIT_FLUSH_EVERY:
            self.flush()

    def _read(self, key: str) -> Entry | None:
        try:
            return self.store.get(key)
        except (StoreError, sqlite3.Error, OSError) as exc:  # a damaged or busy store is a miss
            self.counters["store_errors"] += 1
            self._warn_once("read", "plancache: reading %s failed (%s); treating as a miss", self.store.path, exc)
            return None

    def _lookup_or_build(self, graph: Any, key: CacheKey, options: BuildOptions, inputs: Mapping[int, Any] | None) -> Plan:
        plan = self._load(graph, key, options)
        if plan is not None:
            return plan
        if self.store.read_only:
            return self._build(graph, key, options, inputs, persist=False)
        lock = self._key_lock(key.digest)
        started = time.monotonic()
        try:
            lock.acquire(timeout=1.0)
        except TimeoutError:
            self.counters["waits"] += 1
            log.info("plancache: waiting for another process to build %s (%s)", key.digest[:12], summarize(key.parts["graph"]))
            try:
                lock.acquire(timeout=max(0.0, self.lock_timeout - 1.0))
            except TimeoutError as exc:
                raise LockTimeoutError(
                    f"waited {time.monotonic() - started:.0f} s for another process to build plan {key.digest[:12]}; "
                    f"if no process is building it, remove {lock.lock_file}",
                    key=key.digest,
                    waited_s=time.monotonic() - started,
                ) from exc
        try:
            plan = self._load(graph, key, options)  # built by the process we waited for?
            if plan is not None:
                return plan
            return self._build(graph, key, options, inputs, persist=True)
        finally:
            lock.release()

    def _key_lock(self, digest: str) -> Any:
        from filelock import FileLock  # imported on the first miss only

        locks = self.directory / "locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        return FileLock(str(locks / f"{digest[:32]}.lock"), mode=0o600)

    def _load(self, graph: Any, key: CacheKey, options: BuildOptions) -> Plan | None:
        entry = self._read(key.digest)
        if entry is None:
            return None
        tensors = [TensorSpec.from_dict(t) for t in entry.tensors]
        engine = EngineChoice.from_dict(entry.engine) if entry.engine else None
        reason = None
        if entry.environment != key.parts["environment"]:
            reason = "environment differs from the key's"
        elif not entry.checksum_ok():
            reason = "blob checksum mismatch"
        else:
            try:
                native = self.backend.load(entry.blob, tensors)
            except Exception as exc:  # the library refusing a blob is a miss, never a crash
                reason = f"deserialize failed: {type(exc).__name__}: {exc}"
            else:
                self.counters["hits"] += 1
                self._note_hit(key.digest)
                return self._plan(key.digest, native, tensors, entry.workspace_size, engine, "loaded")
        self._quarantine(key.digest, reason)
        if engine is None or self.store.read_only:
            return None
        return self._rebuild(graph, key, options, entry, engine)

    def _quarantine(self, digest: str, reason: str) -> None:
        self.counters["corrupt"] += 1
        log.warning("plancache: entry %s is unusable (%s); quarantined, rebuilding", digest[:12], reason)
        if self.store.read_only:
            return
        try:
            self.store.quarantine(digest, reason)
        except StoreError as exc:
            self._warn_once("quarantine", "plancache: could not quarantine %s: %s", digest[:12], exc)

    def _rebuild(self, graph: Any, key: CacheKey, options: BuildOptions, old: Entry, engine: EngineChoice) -> Plan | None:
        """Rebuild a damaged entry from its engine id and knobs: no autotuning."""
        started = time.perf_counter()
        try:
            built = self.backend.rebuild(graph, engine, options)
        except Exception as exc:
            log.warning("plancache: rebuilding %s from engine %s failed (%s); autotuning instead", key.digest[:12], engine.name, exc)
            return None
        self.counters["rebuilds"] += 1
        candidates = old.candidates
        self._persist(key, built, old.policy, candidates, old.timing, time.perf_counter() - started, 0.0)
        return self._plan(key.digest, built.native, built.tensors, built.workspace_size, built.engine, "rebuilt")

    def _build(
        self, graph: Any, key: CacheKey, options: BuildOptions, inputs: Mapping[int, Any] | None, *, persist: bool
    ) -> Plan:
        self.counters["misses"] += 1
        started = time.perf_counter()
        cands = self.backend.candidates(graph, options, inputs)
        try:
            result = autotune(cands, options, self.timing)
            built = cands.finish(result.winner)
        finally:
            cands.close()
        self.counters["builds"] += 1
        elapsed = time.perf_counter() - started
        reports = [r.to_dict() for r in result.candidates]
        if persist:
            self._persist(key, built, result.policy, reports, result.timing, elapsed, result.autotune_seconds)
        else:
            self.counters["unpersisted"] += 1
        return self._plan(key.digest, built.native, built.tensors, built.workspace_size, built.engine, "built")

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
        except (StoreError, OSError) as exc:
            self.counters["store_errors"] += 1
            self.counters["unpersisted"] += 1
            self._warn_once("write", "plancache: could not store plan %s (%s); it is used from memory only", key.digest[:12], exc)

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


def _signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a builder's result depends on: tensors by layout, everything else by value."""

    def one(value: Any) -> Any:
        if hasattr(value, "stride") and hasattr(value, "dtype") and hasattr(value, "shape"):
            return (tuple(value.shape), value.stride(), value.dtype, value.device)
        return value

    if kwargs:
        # The marker keeps f(("n", 1)) and f(n=1) apart.
        return (*map(one, args), _KWARGS, *((k, one(v)) for k, v in sorted(kwargs.items())))
    return tuple(map(one, args))


_KWARGS = object()
