"""The lookup pipeline behind ``PlanCache.get``: the steps of ``cache``'s docstring below
memory. ``Lookup`` owns every tier and the flight; ``PlanCache`` is its public face.

Reads take no lock and write nothing: an unsound entry is only a miss there. Inside the
single flight it is judged again, and only that row is quarantined (another process may
have rebuilt the key meanwhile).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from ..autotuning.autotune import AutotuneResult, TimingPolicy, autotune
from ..autotuning.candidates import Candidates
from ..errors import CaptureInProgressError, DamagedEntryError, TransientLoadError
from ..formats.plan_blob import PlanBlob
from ..guest.backend import Backend, BuiltPlan, EngineChoice, Load
from ..guest.tensors import TensorLike
from ..key import JSON, BuildOptions, CacheKey, TensorSpec, canonical_json, environment_id, options_json
from ..runtime.plan import Plan, PlanSource
from ..store import NEVER_CHECKED, Entry, Sound, Unsound, held_to, sha256, summarize
from ..store.per_process import PerProcess
from ..tiers.local import LocalTier
from ..tiers.memory import LRU
from .counters import Count, Counters
from .flight import SingleFlight
from .judging import Judging, code_version
from .kernel_cache import KernelCache
from .keys import GraphKeys
from .loads import Loads
from .unstored import Unstored, Why

if TYPE_CHECKING:
    from ..tiers.remote import RemoteTier

__all__ = ["Lookup", "Primed", "Priming", "Unserved", "Verdict"]

#: How often the primer, waiting for builds to finish, looks whether it should stop.
_IDLE_POLL_S = 0.05

log = logging.getLogger("plancache")


class Verdict(enum.Enum):
    """Why a stored entry is not served."""

    ABSENT = "not stored"
    UNDECODABLE = "the row cannot be decoded"
    UNSOUND = "the entry fails its checks"  # store.entry.unsound: checksums, environment, key
    NEVER_CHECKED = "its engine was never compared with others"  # sound: chosen again, not quarantined
    REFUSED = "the backend refused the plan"  # the library's word on the blob
    LOAD_FAILED = "not loaded now"  # the process's failure, not the entry's: it stays


class Priming(enum.Enum):
    """What priming one stored plan came to."""

    PRIMED = "primed"  # loaded by the primer
    LOADED = "loaded"  # in memory already, or being loaded by a lookup, which then has it
    SKIPPED = "skipped"


@dataclasses.dataclass(frozen=True)
class Primed:
    """What ``Lookup.prime`` came to, and why a plan it skipped was skipped."""

    outcome: Priming
    why: str = ""

    def __str__(self) -> str:
        return self.why if self.outcome is Priming.SKIPPED else self.outcome.value


@dataclasses.dataclass(frozen=True)
class Unserved:
    """A stored entry that is not served: the row (None when absent or undecodable), the
    verdict, and why in words."""

    entry: Entry | None
    verdict: Verdict
    reason: str

    @property
    def quarantine(self) -> bool:
        """Whether the row is unsound for good (damaged, refused): quarantined inside its flight."""
        return self.verdict in (Verdict.UNDECODABLE, Verdict.UNSOUND, Verdict.REFUSED)


_ABSENT = Unserved(None, Verdict.ABSENT, Verdict.ABSENT.value)
Slot = tuple[str, int]  # (key, device)


class _Process:
    """What a forked child of a lookup's process starts without: the parent's loads under
    way (their threads are the parent's), the plans its run noted for auto-prime, and the
    graphs it keyed (whose lock another thread of the parent may have held)."""

    def __init__(self) -> None:
        self.loads = Loads()
        self.used: set[Slot] = set()  # (key, device) this run has noted for auto-prime
        #: (key, device) -> ``time.perf_counter()`` of this run's first lookup of it (the primer's timeline).
        self.first_asked: dict[Slot, float] = {}
        self.keys = GraphKeys()


class Lookup:
    """The plan of a graph on the caller's device: keyed, then from memory, the stored
    tiers, or repaired or built inside the key's single flight. Owns the memory tier, the
    stored tiers, the flight and the environment of each device."""

    def __init__(self, *, backend: Backend, timing: TimingPolicy, local: LocalTier, flight: SingleFlight, remote: RemoteTier | None,
                 counters: Counters, warn: Callable[..., None], max_plans: int, persist_kernel_cache: bool) -> None:  # fmt: skip
        self.backend = backend
        self.timing = timing
        self.local = local
        self.memory: LRU[Slot, Plan] = LRU(max_plans)
        self.flight = flight
        self.remote = remote
        self.counters = counters
        self._warn_once = warn
        self.kernel_cache = KernelCache(backend, local, counters, warn, persist_kernel_cache)
        self.unstored = Unstored(backend, counters, local, warn)  # plans built and never stored, and why
        self.judging = Judging(backend, local)  # with the judgements kept in the store, and keeping them
        #: ``record(graph, key)`` for every graph looked up (manifests, ``PLANCACHE_RECORD``).
        self.recorders: list[Callable[[object, CacheKey], None]] = []
        self.closed = False
        self._environments: dict[int, tuple[dict[str, JSON], str]] = {}
        self._environment_json: dict[str, str] = {}
        self._process = PerProcess(_Process)

    @property
    def loads(self) -> Loads:
        """This process's loads and builds under way."""
        return self._process.get().loads

    @property
    def first_asked(self) -> dict[Slot, float]:
        """(key, device) -> ``time.perf_counter()`` of this run's first lookup of it."""
        return self._process.get().first_asked

    def prepare(self, options: BuildOptions) -> None:
        """Once-per-process work that a first store hit would otherwise do, done by the
        cache as it opens, on a thread beside the program: the judging code's version (its
        source read and hashed), the canonical text of the cache's options, and the start
        of the thread that writes hit counts (a thread's start waits for it to run)."""
        code_version()
        options_json(options)
        self.local.start_flusher()

    # ------------------------------------------------------------------ the key and memory

    def environment(self, device: int) -> tuple[dict[str, JSON], str]:
        """The environment of ``device`` and its id (asked of the backend once per device)."""
        found = self._environments.get(device)
        if found is None:
            env = self.backend.environment(device)
            found = (env, environment_id(env))
            # The encoding first: another thread that finds the device's entry reads its
            # encoding at once, unlocked (encoded once, hashed by every lookup).
            self._environment_json[found[1]] = canonical_json(env)
            self._environments[device] = found
        return found

    def key(self, graph: object, options: BuildOptions, device: int, tag: str | None = None) -> CacheKey:
        """The key ``graph`` is stored under on ``device`` (``tag``: for the callables it holds)."""
        return self.key_and_names(graph, options, device, tag)[0]

    def key_and_names(self, graph: object, options: BuildOptions, device: int, tag: str | None = None,
                      keys: GraphKeys | None = None) -> tuple[CacheKey, dict[str, int]]:  # fmt: skip
        """The key of ``graph`` on ``device`` and its names (``{name: uid}``), computed once
        while the graph object is unchanged (``keys``: this process's, when the caller has them)."""
        environment, env_id = self.environment(device)
        if keys is None:
            keys = self._process.get().keys
        return keys.key(graph, options, environment, env_id, self._environment_json[env_id], tag)

    def get(self, graph: object, options: BuildOptions, inputs: Mapping[int, TensorLike] | None = None, load: Load | None = None,
            tag: str | None = None) -> Plan:  # fmt: skip
        """``PlanCache.get``: the plan of ``graph`` on the current device, under its names."""
        device = self.backend.current_device()
        process = self._process.get()  # asked once per lookup
        key, names = self.key_and_names(graph, options, device, tag, process.keys)
        for record in self.recorders:
            record(graph, key)
        slot = (key.digest, device)
        if slot not in process.used:
            process.first_asked.setdefault(slot, time.perf_counter())
        plan = self.memory.get(slot)
        if plan is not None:
            self.counters.count(Count.MEMORY_HITS)
            self.local.note_hit(key.digest)  # so a long-lived process keeps its plans young for eviction
            plan = plan.named(names)
        else:
            plan = self.resolve(graph, key, names, options, device, inputs, load)  # under these names
        if slot not in process.used:  # once per run: what the next start of this application primes
            process.used.add(slot)
            self.local.note_use(key.digest, device)
        return plan

    # ------------------------------------------------------------------ below memory

    def resolve(self, graph: object, key: CacheKey, names: Mapping[str, int], options: BuildOptions, device: int,
                inputs: Mapping[int, TensorLike] | None, load: Load | None = None) -> Plan:  # fmt: skip
        slot = (key.digest, device)
        started = time.monotonic()  # one lock_timeout for every wait of this lookup
        with self.loads.claim(slot, self.memory, started + self.flight.timeout) as plan:
            if plan is None:  # this thread loads or builds it, as a guest of the program
                environment, env_id = self.environment(device)
                with self.backend.guest(device):
                    plan = self._from_stored_tiers(key, environment, env_id, device, load)
                    if plan is None:
                        with self.flight.hold(key.digest, env_id, summarize(key.parts["graph"]), started=started):
                            plan = self.memory.get(slot) or self._repair_or_build(graph, key, options, device, inputs, load)
                            # In memory before the flight is let go: a lookup nested in another
                            # build (which does not wait for this claim, loads) may be next in it.
                            plan = plan.named(names)
                            self.memory.put(slot, plan)
                            return plan
                plan = plan.named(names)  # a store hit's path: no call more than it needs
                self.memory.put(slot, plan)
                return plan
        return plan.named(names)  # another thread's, under its graph's names

    def prime(self, digest: str, environment: Mapping[str, object], device: int, *, stop: threading.Event | None = None,
              marks: dict[str, tuple[float, float]] | None = None, entry: Entry | None = None,
              ahead: Sound | Unsound | None = None) -> Primed:  # fmt: skip
        """Load the stored plan ``digest`` onto ``device`` into memory ahead of its lookup.
        Returns whether it was primed, loaded already (in memory, or being loaded by a
        lookup, which then has it), or skipped, and why. Gives way to builds: waits until no lookup
        is autotuning before it starts, and never writes (an unsound entry is left
        for its lookup to quarantine and rebuild). ``stop`` ends that wait ("stopped"): a
        lookup may be autotuning for minutes while the cache is being closed. ``entry`` and
        ``ahead``: the entry as read ahead of the device, and its verdict judged without an environment."""
        slot = (digest, device)
        started = time.perf_counter()
        while not self.loads.wait_until_no_build(timeout=_IDLE_POLL_S):
            if stop is not None and stop.is_set():
                return Primed(Priming.SKIPPED, "stopped")
        if marks is not None:
            marks["wait"] = (started, time.perf_counter())
        with self.loads.try_claim(slot, self.memory) as mine:
            if not mine:
                return Primed(Priming.LOADED)
            try:
                entering = time.perf_counter()
                with self.backend.guest(device):
                    if marks is not None:
                        marks["enter"] = (entering, time.perf_counter())
                    outcome = self.serve_stored(digest, environment, device, count_hit=False, marks=marks, entry=entry,
                                                ahead=ahead)  # fmt: skip
            except CaptureInProgressError:
                return Primed(Priming.SKIPPED, "this thread is capturing")
            if isinstance(outcome, Plan):
                self.memory.put(slot, outcome)
                self.counters.count(Count.PRIMED)
                return Primed(Priming.PRIMED)
            return Primed(Priming.SKIPPED, outcome.reason)

    def _from_stored_tiers(self, key: CacheKey, environment: Mapping[str, object], env_id: str, device: int,
                           load: Load | None) -> Plan | None:  # fmt: skip
        """A sound stored plan from the local store, else from the fleet (then stored
        locally); None otherwise. Reads only: an unsound entry is just a miss here."""
        outcome = self.serve_stored(key.digest, environment, device, load=load, key=key)
        return outcome if isinstance(outcome, Plan) else self._from_remote(key, environment, env_id, device, load)

    def _from_remote(self, key: CacheKey, environment: Mapping[str, object], env_id: str, device: int,
                     load: Load | None) -> Plan | None:  # fmt: skip
        """A sound plan from the fleet, stored locally, then loaded; None without one."""
        if self.remote is None:
            return None
        entry = self.remote.get(key.digest, env_id)
        if entry is None:
            return None
        verdict = self.judging.judge(entry, environment, env_id)
        if not isinstance(verdict, Sound) or not verdict.entry.checked:
            return None
        self.local.put(entry)
        loaded = self._load(verdict, device, load=load)
        return loaded if isinstance(loaded, Plan) else None

    def _repair_or_build(self, graph: object, key: CacheKey, options: BuildOptions, device: int,
                         inputs: Mapping[int, TensorLike] | None, load: Load | None) -> Plan:  # fmt: skip
        """Inside the key's single flight: serve what this machine or the fleet stored
        meanwhile, repair an unsound entry, or autotune."""
        environment, env_id = self.environment(device)
        # The whole row: a rebuild of an unsound entry keeps its candidates and timing records.
        outcome = self.serve_stored(key.digest, environment, device, load=load, key=key, details=True)
        if isinstance(outcome, Plan):
            return outcome
        if outcome.verdict is Verdict.NEVER_CHECKED:  # sound, but its engine was never compared with others
            self.counters.count(Count.RECHECKS)
            return self._build(graph, key, options, inputs, device, load=load)
        if outcome.verdict is Verdict.LOAD_FAILED:  # not the entry's fault: it stays
            return self._build(graph, key, options, inputs, device, persist=False, load=load)
        if outcome.quarantine:
            self.quarantine_if_unchanged(key.digest, outcome.entry, outcome.reason)
            rebuilt = self._rebuild(key, options, outcome.entry, device, load) if outcome.entry is not None else None
            if rebuilt is not None:
                return rebuilt
        else:  # absent here: the local store was just read, the fleet may have it
            plan = self._from_remote(key, environment, env_id, device, load)
            if plan is not None:
                return plan
        return self._build(graph, key, options, inputs, device, load=load)

    def preload(self, keys: Iterable[str], device: int) -> dict[str, object]:
        """``PlanCache.preload``: each key loaded into memory (once, with the primer and
        lookups, through the load claims), an unsound entry of this environment quarantined
        inside its flight. ``{"loaded", "missing", "failed": {key: reason}, "seconds"}``."""
        started = time.perf_counter()
        environment, env_id = self.environment(device)
        loaded: list[str] = []
        missing: list[str] = []
        failed: dict[str, str] = {}
        for digest in keys:
            slot = (digest, device)
            with self.loads.claim(slot, self.memory) as plan, self.backend.guest(device):
                outcome = plan if plan is not None else self.serve_stored(digest, environment, device)
                if isinstance(outcome, Plan):
                    self.memory.put(slot, outcome)
                    loaded.append(digest)
                elif outcome.verdict is Verdict.ABSENT:
                    missing.append(digest)
                elif outcome.entry is not None and outcome.entry.environment != environment:
                    failed[digest] = "entry belongs to another environment"  # kept for its own machines
                elif not outcome.quarantine:
                    failed[digest] = outcome.reason  # kept: its lookup chooses it again, or loads it later
                else:
                    with self.flight.hold(digest, env_id):
                        self.quarantine_if_unchanged(digest, outcome.entry, outcome.reason)
                    failed[digest] = outcome.reason
        return {"loaded": loaded, "missing": missing, "failed": failed, "seconds": time.perf_counter() - started}

    def serve_stored(self, digest: str, environment: Mapping[str, object], device: int, *, count_hit: bool = True,
                     load: Load | None = None, marks: dict[str, tuple[float, float]] | None = None,
                     entry: Entry | None = None, key: CacheKey | None = None, details: bool = False,
                     ahead: Sound | Unsound | None = None) -> Plan | Unserved:  # fmt: skip
        """The local entry under ``digest`` (``entry``: as read already; ``ahead``: its
        verdict, judged ahead without an environment, see ``store.held_to``), judged and loaded
        (by ``load``, else the backend): a ``Plan``, else why it is not served.
        ``count_hit``: whether loading it counts as a hit (priming is not one: it may go
        unused). ``marks``: see ``prime``. ``key``: the lookup's, whose texts the row's
        columns are compared with rather than decoded; ``details``: read the candidates' and
        timing records too (a hit needs neither)."""
        started = time.perf_counter()
        given = entry is not None
        if entry is None:
            try:
                entry = self.local.get(digest, self._known(device, key), details)
            except DamagedEntryError as exc:  # one undecodable row
                return Unserved(None, Verdict.UNDECODABLE, f"entry cannot be decoded: {str(exc.__cause__ or exc)[:200]}")
        if entry is None:
            return _ABSENT
        if ahead is not None and given:
            verdict = held_to(ahead, environment)
        else:
            verdict = self.judging.judge(entry, environment, self.environment(device)[1], key)
        if isinstance(verdict, Unsound):
            return Unserved(entry, Verdict.UNSOUND, verdict.reason)
        if not entry.checked:
            return Unserved(entry, Verdict.NEVER_CHECKED, NEVER_CHECKED)
        if marks is not None:
            marks["judge" if given else "read"] = (started, time.perf_counter())
        return self._load(verdict, device, count_hit=count_hit, load=load, marks=marks)

    def _known(self, device: int, key: CacheKey | None) -> dict[str, tuple[str, JSON]]:
        """The columns of a row that the lookup has decoded already: ``(text, value)`` of the
        device's environment, and of the key's graph and options (see ``Entry.from_row``)."""
        environment, env_id = self.environment(device)
        known: dict[str, tuple[str, JSON]] = {"environment_json": (self._environment_json[env_id], environment)}
        if key is not None and key.texts:
            known["graph_json"] = (key.texts["graph"], key.parts["graph"])
            known["options_json"] = (key.texts["options"], key.parts["options"])
        return known

    def _load(self, sound: Sound, device: int, *, count_hit: bool = True, load: Load | None = None,
              marks: dict[str, tuple[float, float]] | None = None) -> Plan | Unserved:  # fmt: skip
        """Deserialize a sound entry onto ``device`` (by ``load``, else the backend), from
        what its judge read (the blob's decoding, the tensor table): a ``Plan``, or why it failed."""
        started = time.perf_counter()
        entry, tensors = sound.entry, list(sound.tensors)
        try:
            native = (load or self.backend.load)(sound.blob, tensors, device)
            if marks is not None:
                marks["finalize"] = (started, time.perf_counter())
        except TransientLoadError as exc:
            # Not the entry's fault (a capture on another thread, an out-of-memory in the
            # warm-up): it stays, to be loaded again later; counted.
            self.counters.count(Count.LOAD_FAILURES)
            self._warn_once(f"load-{entry.key}", "plancache: loading %s failed (%s: %s); the entry is kept, and this "
                            "lookup builds the plan without storing it", entry.key[:12], type(exc).__name__, str(exc)[:200])  # fmt: skip
            return Unserved(entry, Verdict.LOAD_FAILED, f"{Verdict.LOAD_FAILED.value}: {type(exc).__name__}: {str(exc)[:300]}")
        except Exception as exc:  # the library refusing the blob: a check of the entry, which failed
            return Unserved(entry, Verdict.REFUSED, f"{Verdict.REFUSED.value}: {type(exc).__name__}: {str(exc)[:300]}")
        self.judging.loaded(sound)
        if count_hit:
            self.counters.count(Count.HITS)
            self.local.note_hit(entry.key)
        return self._plan(entry.key, native, tensors, entry.workspace_size, _engine_of(entry.engine), PlanSource.LOADED, device)

    def quarantine_if_unchanged(self, digest: str, entry: Entry | None, reason: str) -> None:
        """Quarantine the row that was judged (its recorded checksum), inside the key's
        single flight: a row another process rebuilt meanwhile is left in service."""
        self.counters.count(Count.CORRUPT)
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
            from ..cudnn.replay import rebuild_graph

            built = self.backend.rebuild(rebuild_graph(key.parts["graph"]), engine, options)
        except Exception as exc:
            log.warning(
                "plancache: rebuilding %s from engine %s failed (%s); autotuning instead", key.digest[:12], engine.name, exc
            )
            return None
        self.counters.count(Count.REBUILDS)
        # The unsound entry's autotuning record still says why this engine was chosen.
        timing = old.timing or {"method": "rebuilt from the stored engine id and knobs"}
        native = self._persist(key, built, old.policy, old.candidates, timing, time.perf_counter() - started, 0.0, old.check,
                               device, load)  # fmt: skip
        return self._plan(key.digest, native, built.tensors, built.workspace_size, built.engine, PlanSource.REBUILT, device)

    def retune(self, graph: object, key: CacheKey, options: BuildOptions, device: int) -> Plan:
        """Autotune ``graph`` again without a budget, inside the key's single flight; the
        choice replaces the stored entry and this process's plan in memory."""
        _, env_id = self.environment(device)
        with self.backend.guest(device), self.flight.hold(key.digest, env_id, summarize(key.parts["graph"])):
            plan = self._build(graph, key, options, None, device, budget=math.inf)
        self.memory.put((key.digest, device), plan)
        return plan

    def _build(self, graph: object, key: CacheKey, options: BuildOptions, inputs: Mapping[int, TensorLike] | None, device: int,
               persist: bool = True, load: Load | None = None, budget: float | None = None) -> Plan:  # fmt: skip
        self.counters.count(Count.MISSES)
        started = time.perf_counter()
        dynamic = bool(key.parts["graph"].get("flags", {}).get("dynamic_shape"))
        if dynamic:
            self.kernel_cache.restore(environment_id(key.parts["environment"]))
        with self.loads.building():  # the primer waits meanwhile: its host work would disturb the timings
            cands = Candidates.of(self.backend, graph, options, key.parts["graph"], inputs)
            try:
                timing = self.timing if budget is None else dataclasses.replace(self.timing, budget=budget)
                result = autotune(cands, options, timing, started=started)
                built = cands.finish(result.winner)
            finally:
                cands.close()
        self.counters.count(Count.BUILDS)
        if dynamic:
            self.kernel_cache.save(environment_id(key.parts["environment"]))
        if not result.persist:
            return self._unpersisted(key, built, result, device)
        if not persist:  # the stored entry could not be loaded: it stays as it is
            return self._plan(key.digest, built.native, built.tensors, built.workspace_size, built.engine, PlanSource.UNPERSISTED,
                              device)  # fmt: skip
        reports = [r.to_dict() for r in result.candidates]
        native = self._persist(key, built, result.policy, reports, result.timing, time.perf_counter() - started,
                               result.autotune_seconds, result.check, device, load)  # fmt: skip
        return self._plan(key.digest, native, built.tensors, built.workspace_size, built.engine, PlanSource.BUILT, device)

    def _unpersisted(self, key: CacheKey, built: BuiltPlan, result: AutotuneResult, device: int) -> Plan:
        """Candidates without a majority: this process runs what the frontend itself would
        (its heuristic choice), and nothing is stored or published."""
        self.counters.count(Count.NO_MAJORITY)
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
        return self._plan(key.digest, built.native, built.tensors, built.workspace_size, built.engine, PlanSource.UNPERSISTED,
                          device)  # fmt: skip

    def _persist(self, key: CacheKey, built: BuiltPlan, policy: str, candidates: list[dict[str, JSON]],
                 timing: dict[str, JSON], build_seconds: float, autotune_seconds: float,
                 check: dict[str, JSON] | None, device: int, load: Load | None) -> object:  # fmt: skip
        """Store ``built`` once it loaded back from its blob and the judge accepts it as every
        later lookup will judge it; returns what this process runs: the plan loaded back
        (launched as every later process launches it), else the plan as built. A plan that
        cannot be loaded back, or that the judge refuses, is never stored or published
        (``cache.unstored``): storing it would only make each later start refuse it."""
        blob = PlanBlob(built.blob)  # decoded once, for the load back and the judge
        loaded = self.unstored.load_back(key, built, blob, device, load)
        if loaded is None:  # a later lookup could not load it: never stored
            return built.native
        entry = _entry(key, built, self.backend.name, policy, candidates, timing, build_seconds, autotune_seconds, check)
        verdict = self.judging.judge(entry, key.parts["environment"], self.environment(device)[1], key, blob)
        if isinstance(verdict, Unsound):  # what the frontend built for this graph, refused: the judge is wrong
            self.unstored.note(key, Why.JUDGE_DISAGREES, verdict.reason, entry)
            return loaded
        if not self.local.put(entry):
            self.counters.count(Count.UNPERSISTED)
        else:
            self.judging.loaded(verdict)  # judged as a later lookup judges it: kept for that lookup
        if self.remote is not None:
            self.remote.put(entry)  # inside the fleet lock: nodes waiting on it find the plan
        return loaded

    def _plan(self, digest: str, native: object, tensors: list[TensorSpec], workspace: int, engine: EngineChoice | None,
              source: PlanSource, device: int) -> Plan:  # fmt: skip
        return Plan(key=digest, backend=self.backend, native=native, tensors=tensors, workspace_size=workspace,
                    engine=engine, source=source, device=device)  # fmt: skip


def _entry(key: CacheKey, built: BuiltPlan, backend: str, policy: str, candidates: list[dict[str, JSON]],
           timing: dict[str, JSON], build_seconds: float, autotune_seconds: float, check: dict[str, JSON] | None) -> Entry:  # fmt: skip
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


def _engine_of(engine: Mapping[str, object] | None) -> EngineChoice | None:
    """The recorded engine and knobs, or None when absent or damaged (then: autotune)."""
    try:
        return EngineChoice.from_dict(engine) if engine else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
