"""The lookup behind ``PlanCache.get``: stored tiers, then the key's single flight, then
a repair or a build. Each step reads like the life of a lookup in ``cache``'s docstring.

Reads take no lock and write nothing: an entry that ``store.entry.problem`` finds unsound
is only a miss there. Inside the single flight, the same entry is judged again, and only
that row is quarantined (another process may have rebuilt the key meanwhile); its engine
and knobs are rebuilt on a graph replayed from its description, so the caller's graph stays
unplanned for autotuning if the rebuild fails.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..engines.autotune import AutotuneResult, TimingPolicy, autotune
from ..engines.backend import Backend, BuiltPlan, EngineChoice, Load
from ..errors import CaptureInProgressError, DamagedEntryError, TransientLoadError
from ..key import BuildOptions, CacheKey, TensorSpec, environment_id
from ..runtime.plan import Plan, names_of
from ..store import NEVER_CHECKED, Entry, problem, sha256, summarize
from ..tiers.local import LocalTier
from ..tiers.memory import LRU
from .flight import SingleFlight
from .kernel_cache import KernelCache
from .loads import Loads
from .unloadable import Unloadable

__all__ = ["LOAD_FAILED", "Lookup"]

#: How a sound entry that could not be loaded for a transient reason is reported (it is
#: never quarantined for it).
LOAD_FAILED = "not loaded now"
#: How often the primer, waiting for lookups to finish, looks whether it should stop.
_IDLE_POLL_S = 0.05

log = logging.getLogger("plancache")


class Lookup:
    """Finds, repairs or builds the plan of one key on one device for a ``PlanCache``."""

    def __init__(self, *, backend: Backend, timing: TimingPolicy, local: LocalTier, memory: LRU[tuple[str, int], Plan],
                 flight: SingleFlight, remote: Any, counters: dict[str, int], warn: Callable[..., None],
                 environment: Callable[[int], tuple[dict[str, Any], str]], persist_kernel_cache: bool) -> None:  # fmt: skip
        self.backend = backend
        self.timing = timing
        self.local = local
        self.memory = memory
        self.flight = flight
        self.remote = remote
        self.counters = counters
        self._warn_once = warn
        self._environment = environment
        self.kernel_cache = KernelCache(backend, local, counters, warn, persist_kernel_cache)
        self.loads = Loads()
        self.unloadable = Unloadable(backend, counters, warn)  # plans never stored: they could not be loaded back

    def resolve(self, graph: Any, key: CacheKey, options: BuildOptions, device: int, inputs: Mapping[int, Any] | None,
                load: Load | None = None) -> Plan:  # fmt: skip
        slot = (key.digest, device)
        names = names_of(graph)
        started = time.monotonic()  # one lock_timeout for every wait of this lookup
        with self.loads.claim(slot, self.memory, started + self.flight.timeout) as plan:
            if plan is None:  # this thread loads or builds it, as a guest of the program
                environment, env_id = self._environment(device)
                with self.backend.guest(device):
                    plan = self._from_stored_tiers(key, environment, env_id, device, load)
                    if plan is None:
                        with self.flight.hold(key.digest, env_id, summarize(key.parts["graph"]), started=started):
                            plan = self.memory.get(slot) or self._repair_or_build(graph, key, options, device, inputs, load)
                plan = plan.named(names)
                self.memory.put(slot, plan)
        return plan.named(names)

    def prime(self, digest: str, environment: Mapping[str, Any], device: int, *, stop: threading.Event | None = None) -> str:
        """Load the stored plan ``digest`` onto ``device`` into memory ahead of its lookup.
        Returns "primed", "loaded" (in memory already, or being loaded by a lookup, which
        then has it), or why it was skipped. Gives way to lookups: waits until none is
        loading or building before it starts, and never writes (an unsound entry is left
        for its lookup to quarantine and rebuild). ``stop`` ends that wait ("stopped"): a
        lookup may be autotuning for minutes while the cache is being closed."""
        slot = (digest, device)
        while not self.loads.wait_until_idle(timeout=_IDLE_POLL_S):
            if stop is not None and stop.is_set():
                return "stopped"
        with self.loads.try_claim(slot, self.memory) as mine:
            if not mine:
                return "loaded"
            try:
                with self.backend.guest(device):
                    outcome = self.serve_stored(digest, environment, device, count_hit=False)
            except CaptureInProgressError:
                return "this thread is capturing"
            if isinstance(outcome, Plan):
                self.memory.put(slot, outcome)
                self.counters["primed"] += 1
                return "primed"
            return "not stored" if outcome is None else outcome[1]

    def _from_stored_tiers(self, key: CacheKey, environment: dict[str, Any], env_id: str, device: int,
                           load: Load | None) -> Plan | None:  # fmt: skip
        """A sound stored plan from the local store, else from the fleet (then stored
        locally); None otherwise. Reads only: an unsound entry is just a miss here."""
        outcome = self.serve_stored(key.digest, environment, device, load=load)
        if isinstance(outcome, Plan):
            return outcome
        return self._from_remote(key, environment, env_id, device, load)

    def _from_remote(self, key: CacheKey, environment: dict[str, Any], env_id: str, device: int,
                     load: Load | None) -> Plan | None:  # fmt: skip
        """A sound plan from the fleet, stored locally, then loaded; None without one."""
        if self.remote is None:
            return None
        entry = self.remote.get(key.digest, env_id)
        if entry is None or problem(entry, environment) is not None:
            return None
        self.local.put(entry)
        loaded = self._load(entry, device, load=load)
        return loaded if isinstance(loaded, Plan) else None

    def _repair_or_build(self, graph: Any, key: CacheKey, options: BuildOptions, device: int,
                         inputs: Mapping[int, Any] | None, load: Load | None) -> Plan:  # fmt: skip
        """Inside the key's single flight: serve what this machine or the fleet stored
        meanwhile, repair an unsound entry, or autotune."""
        environment, env_id = self._environment(device)
        outcome = self.serve_stored(key.digest, environment, device, load=load)
        if isinstance(outcome, Plan):
            return outcome
        if outcome is not None:
            entry, reason = outcome
            if reason == NEVER_CHECKED:  # sound, but its engine was never compared with others
                self.counters["rechecks"] += 1
                return self._build(graph, key, options, inputs, device, load=load)
            if reason.startswith(LOAD_FAILED):  # not the entry's fault: it stays
                return self._build(graph, key, options, inputs, device, persist=False, load=load)
            self.quarantine_if_unchanged(key.digest, entry, reason)
            rebuilt = self._rebuild(key, options, entry, device, load) if entry is not None else None
            if rebuilt is not None:
                return rebuilt
        else:
            plan = self._from_remote(key, environment, env_id, device, load)  # the local store was just read
            if plan is not None:
                return plan
        return self._build(graph, key, options, inputs, device, load=load)

    def preload(self, keys: Iterable[str], device: int) -> dict[str, Any]:
        """``PlanCache.preload``: each key loaded into memory (once, with the primer and
        lookups, through the load claims), an unsound entry of this environment quarantined
        inside its flight. ``{"loaded", "missing", "failed": {key: reason}, "seconds"}``."""
        started = time.perf_counter()
        environment, env_id = self._environment(device)
        report: dict[str, Any] = {"loaded": [], "missing": [], "failed": {}}
        for digest in keys:
            slot = (digest, device)
            with self.loads.claim(slot, self.memory) as plan, self.backend.guest(device):
                outcome = plan if plan is not None else self.serve_stored(digest, environment, device)
                if isinstance(outcome, Plan):
                    self.memory.put(slot, outcome)
                    report["loaded"].append(digest)
                elif outcome is None:
                    report["missing"].append(digest)
                elif outcome[0] is not None and outcome[0].environment != environment:
                    report["failed"][digest] = "entry belongs to another environment"  # kept for its own machines
                elif outcome[1] == NEVER_CHECKED or outcome[1].startswith(LOAD_FAILED):
                    report["failed"][digest] = outcome[1]  # kept: its lookup chooses it again, or loads it later
                else:
                    with self.flight.hold(digest, env_id):
                        self.quarantine_if_unchanged(digest, outcome[0], outcome[1])
                    report["failed"][digest] = outcome[1]
        report["seconds"] = time.perf_counter() - started
        return report

    def serve_stored(self, digest: str, environment: Mapping[str, Any], device: int, *, count_hit: bool = True,
                     load: Load | None = None) -> Plan | tuple[Entry | None, str] | None:  # fmt: skip
        """The local entry under ``digest``, judged and loaded (by ``load``, else the backend):
        a ``Plan``; ``(entry, reason)`` when it must not be served; None when there is none.
        ``count_hit``: whether loading it counts as a hit (priming is not one: it may go unused)."""
        try:
            entry = self.local.get(digest)
        except DamagedEntryError as exc:  # one undecodable row
            return None, f"entry cannot be decoded: {str(exc.__cause__ or exc)[:200]}"
        if entry is None:
            return None
        reason = problem(entry, environment)
        if reason is not None:
            return entry, reason
        loaded = self._load(entry, device, count_hit=count_hit, load=load)
        return loaded if isinstance(loaded, Plan) else (entry, loaded)

    def _load(self, entry: Entry, device: int, *, count_hit: bool = True, load: Load | None = None) -> Plan | str:
        """Deserialize a sound entry onto ``device`` (by ``load``, else the backend): a ``Plan``, or why it failed."""
        try:
            tensors = [TensorSpec.from_dict(t) for t in entry.tensors]
            native = (load or self.backend.load)(entry.blob, tensors, device)
        except TransientLoadError as exc:
            # Not the entry's fault (a capture on another thread, an out-of-memory in the
            # warm-up): it stays, to be loaded again later; counted.
            self.counters["load_failures"] += 1
            self._warn_once(f"load-{entry.key}", "plancache: loading %s failed (%s: %s); the entry is kept, and this "
                            "lookup builds the plan without storing it", entry.key[:12], type(exc).__name__, str(exc)[:200])  # fmt: skip
            return f"{LOAD_FAILED}: {type(exc).__name__}: {str(exc)[:300]}"
        except Exception as exc:  # the library refusing the blob: a check of the entry, which failed
            return f"the backend refused the plan: {type(exc).__name__}: {str(exc)[:300]}"
        if count_hit:
            self.counters["hits"] += 1
            self.local.note_hit(entry.key)
        return self._plan(entry.key, native, tensors, entry.workspace_size, _engine_of(entry.engine), "loaded", device)

    def quarantine_if_unchanged(self, digest: str, entry: Entry | None, reason: str) -> None:
        """Quarantine the row that was judged (its recorded checksum), inside the key's
        single flight: a row another process rebuilt meanwhile is left in service."""
        self.counters["corrupt"] += 1
        log.warning("plancache: entry %s is unusable (%s); quarantined, rebuilding", digest[:12], reason)
        self.local.quarantine(digest, entry, reason)

    def _rebuild(self, key: CacheKey, options: BuildOptions, old: Entry, device: int, load: Load | None) -> Plan | None:
        """Rebuild an unsound entry from its engine id and knobs on a graph replayed from
        its description (the caller's graph stays unplanned, for autotuning if this fails)."""
        engine = _engine_of(old.engine)
        if engine is None or self.local.read_only:
            return None
        started = time.perf_counter()
        try:
            from ..engines.replay import rebuild_graph

            built = self.backend.rebuild(rebuild_graph(key.parts["graph"]), engine, options)
        except Exception as exc:
            log.warning(
                "plancache: rebuilding %s from engine %s failed (%s); autotuning instead", key.digest[:12], engine.name, exc
            )
            return None
        self.counters["rebuilds"] += 1
        # The unsound entry's autotuning record still says why this engine was chosen.
        timing = old.timing or {"method": "rebuilt from the stored engine id and knobs"}
        native = self._persist(key, built, old.policy, old.candidates, timing, time.perf_counter() - started, 0.0, old.check,
                               device, load)  # fmt: skip
        return self._plan(key.digest, native, built.tensors, built.workspace_size, built.engine, "rebuilt", device)

    def retune(self, graph: Any, key: CacheKey, options: BuildOptions, device: int) -> Plan:
        """Autotune ``graph`` again without a budget, inside the key's single flight; the
        choice replaces the stored entry and this process's plan in memory."""
        _, env_id = self._environment(device)
        with self.backend.guest(device), self.flight.hold(key.digest, env_id, summarize(key.parts["graph"])):
            plan = self._build(graph, key, options, None, device, budget=math.inf)
        self.memory.put((key.digest, device), plan)
        return plan

    def _build(self, graph: Any, key: CacheKey, options: BuildOptions, inputs: Mapping[int, Any] | None, device: int,
               persist: bool = True, load: Load | None = None, budget: float | None = None) -> Plan:  # fmt: skip
        self.counters["misses"] += 1
        started = time.perf_counter()
        dynamic = bool(key.parts["graph"].get("flags", {}).get("dynamic_shape"))
        if dynamic:
            self.kernel_cache.restore(environment_id(key.parts["environment"]))
        cands = self.backend.candidates(graph, options, key.parts["graph"], inputs)
        try:
            timing = self.timing if budget is None else dataclasses.replace(self.timing, budget=budget)
            result = autotune(cands, options, timing, started=started)
            built = cands.finish(result.winner)
        finally:
            cands.close()
        self.counters["builds"] += 1
        if dynamic:
            self.kernel_cache.save(environment_id(key.parts["environment"]))
        if not result.persist:
            return self._unpersisted(key, built, result, device)
        if not persist:  # the stored entry could not be loaded: it stays as it is
            return self._plan(key.digest, built.native, built.tensors, built.workspace_size, built.engine, "unpersisted", device)
        reports = [r.to_dict() for r in result.candidates]
        native = self._persist(key, built, result.policy, reports, result.timing, time.perf_counter() - started,
                               result.autotune_seconds, result.check, device, load)  # fmt: skip
        return self._plan(key.digest, native, built.tensors, built.workspace_size, built.engine, "built", device)

    def _unpersisted(self, key: CacheKey, built: BuiltPlan, result: AutotuneResult, device: int) -> Plan:
        """Candidates without a majority: this process runs what the frontend itself would
        (its heuristic choice), and nothing is stored or published."""
        self.counters["no_majority"] += 1
        check = result.check
        groups = "; ".join(" = ".join(str(n) for n in group) for group in check.get("groups", []))
        spread = check.get("spread")
        log.warning(
            "plancache: the candidates of %s (%s) disagree and no majority agrees: %s (worst element %s times its bound, "
            "over %s); not persisting it: this process runs the frontend's heuristic choice %s",
            key.digest[:12], summarize(key.parts["graph"]), groups,
            f"{spread['worst']:.3g}" if spread and spread.get("worst") is not None else "not finite (NaN, infinity or integer)",
            check.get("far"), built.engine.name if built.engine else f"#{result.winner}",
        )  # fmt: skip
        return self._plan(key.digest, built.native, built.tensors, built.workspace_size, built.engine, "unpersisted", device)

    def _persist(self, key: CacheKey, built: BuiltPlan, policy: str, candidates: list[dict[str, Any]],
                 timing: dict[str, Any], build_seconds: float, autotune_seconds: float,
                 check: dict[str, Any] | None, device: int, load: Load | None) -> Any:  # fmt: skip
        """Store ``built`` once it loaded back from its blob; returns what this process runs:
        the plan loaded back (launched as every later process launches it), else the plan
        as built, which is then never stored."""
        loaded = self.unloadable.load_back(key, built, device, load)
        if loaded is None:  # a later lookup could not load it: never stored
            return built.native
        entry = _entry(key, built, self.backend.name, policy, candidates, timing, build_seconds, autotune_seconds, check)
        if not self.local.put(entry):
            self.counters["unpersisted"] += 1
        if self.remote is not None:
            self.remote.put(entry)  # inside the fleet lock: nodes waiting on it find the plan
        return loaded

    def _plan(self, digest: str, native: Any, tensors: list[TensorSpec], workspace: int, engine: EngineChoice | None,
              source: str, device: int) -> Plan:  # fmt: skip
        return Plan(key=digest, backend=self.backend, native=native, tensors=tensors, workspace_size=workspace,
                    engine=engine, source=source, device=device)  # fmt: skip


def _entry(key: CacheKey, built: BuiltPlan, backend: str, policy: str, candidates: list[dict[str, Any]],
           timing: dict[str, Any], build_seconds: float, autotune_seconds: float, check: dict[str, Any] | None) -> Entry:  # fmt: skip
    """The stored form of a plan just built or rebuilt: the plan and everything about how it was made."""
    now = time.time()
    return Entry(
        key=key.digest, env_id=environment_id(key.parts["environment"]), label=summarize(key.parts["graph"]),
        description=key.parts["graph"], environment=key.parts["environment"], options=key.parts["options"],
        tensors=[t.to_dict() for t in built.tensors], blob=built.blob, blob_sha256=sha256(built.blob),
        engine=built.engine.to_dict() if built.engine else None, workspace_size=built.workspace_size,
        policy=policy, candidates=candidates, timing=timing, build_seconds=build_seconds,
        autotune_seconds=autotune_seconds, backend=backend, created_at=now, last_used_at=now, check=check,
    )  # fmt: skip


def _engine_of(engine: Mapping[str, Any] | None) -> EngineChoice | None:
    """The recorded engine and knobs, or None when absent or damaged (then: autotune)."""
    try:
        return EngineChoice.from_dict(engine) if engine else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
