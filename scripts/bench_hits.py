#!/usr/bin/env python3
"""Hit benchmark: the figures behind "hits never wait", on the CPU test backend.

Runs the whole cache with ``plancache.testing.CpuTestBackend`` (real ``cudnn.pygraph``
graphs, keyed and stored exactly as on a GPU; no GPU needed) and prints one labelled row
per figure, each beside its target:

1. hits while another process holds the store's write lock for 3 s: a plain ``sqlite3``
   process runs ``BEGIN IMMEDIATE``, sleeps, commits; meanwhile fresh caches (the hit-count
   writer's interval shortened, so it tries to write during the lock) serve memory hits
   and store hits for 2.5 s. Worst, p99, p50; the writer's tries (each refused at once by
   the store; its wall time includes waiting for the GIL, which the hits do not wait on);
   and whether every hit count reached the store once the lock was released.
2. ``cache.get(graph)`` of an already-loaded plan (a 3-node conv+bias+relu pygraph): the
   same graph object again (its key is reused while the graph is unchanged), beside the
   memory tier's own lookup; then a fresh graph each call (graphs built before timing:
   described and keyed each time), with ``describe`` and ``make_key`` alone.
3. a ``@cache.builder`` call with four torch CPU tensors of an already-seen signature.
4. a fresh process's store hits in a store of 10,000 entries: 1,000 distinct keys, each
   looked up once (a store hit, never a memory hit); then the same in a second fresh
   process, the first having kept the judgement of each row it hit (``store.kept``).

Rows 1 and 4 also show Python's garbage-collector passes during the timed lookups: a
full collection of a large heap (1,000 graphs and plans are kept alive) is a pause of the
runtime that no lookup can avoid, and it sets the worst case. Each row's title ends with
a speed check in brackets (microseconds of ``sum(range(1000))`` just before it): on a
shared machine, compare runs only where it reads alike.

Missed targets are printed as MISSED and do not change the exit code; the exit code is 1
only when a run failed (a subprocess died, a hit came from another tier than its label
says, hit counts were lost). ``--json FILE`` writes every figure; ``--quick`` runs tiny
sizes (seconds, for tests). Run from anywhere: ``python scripts/bench_hits.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "tests", ROOT):  # this checkout's plancache (and its test graphs) win
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import benchlib  # noqa: E402 - scripts/ is sys.path[0] when run as a script

# Only the local tier is measured: no Redis tier, no recorder, no size limit from the caller.
for _name in ("PLANCACHE_REDIS_URL", "PLANCACHE_RECORD", "PLANCACHE_MAX_SIZE", "PLANCACHE_MEMORY_PLANS", "PLANCACHE_DIR"):
    os.environ.pop(_name, None)
# Lookups are measured, not priming: a primer would turn the store hits timed here into
# memory hits (children inherit this).
os.environ["PLANCACHE_AUTO_PRIME"] = "0"

TARGETS = {  # figure -> (limit, unit)
    "lock_worst_ms": (50.0, "ms"),
    "get_repeat_median_us": (20.0, "us"),
    "get_fresh_median_us": (50.0, "us"),
    "builder_repeat_median_us": (4.0, "us"),
    "store_hit_p50_ms": (1.0, "ms"),
    "store_hit_p99_ms": (1.0, "ms"),
}

FULL = {
    "lock_hold_s": 3.0, "lock_loop_s": 2.5, "flush_s": 0.05,
    "get_n": 2000, "get_warmup": 200,
    "builder_batches": 40, "builder_batch": 2000,
    "store_entries": 10_000, "store_timed": 1000, "store_warmup": 20,
}  # fmt: skip
QUICK = {
    "lock_hold_s": 3.0, "lock_loop_s": 0.6, "flush_s": 0.05,
    "get_n": 100, "get_warmup": 20,
    "builder_batches": 5, "builder_batch": 200,
    "store_entries": 300, "store_timed": 50, "store_warmup": 5,
}  # fmt: skip

# Holds the write lock of a plan store with nothing but sqlite3: the other process of row 1.
LOCK_HOLDER = """
import select, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
select.select([sys.stdin], [], [], float(sys.argv[2]))  # until the bench is done (stdin closes), at most this long
conn.execute("COMMIT")
conn.close()
print("released", flush=True)
"""


class BenchError(Exception):
    """A run that failed: its figures would not measure what their labels say."""


# ---------------------------------------------------------------------- helpers


def pct(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def calibrate() -> float:
    """Microseconds of a fixed pure-Python loop (median of 21 batches): on a shared or
    throttled machine, compare it across runs before comparing their figures."""
    times = []
    for _ in range(21):
        t0 = time.perf_counter_ns()
        for _ in range(100):
            sum(range(1000))
        times.append((time.perf_counter_ns() - t0) / 100 / 1e3)
    return statistics.median(times)


def machine() -> dict[str, Any]:
    import cudnn

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpus": os.cpu_count(), "cpu": cpu, "load_before": load,
            "python": platform.python_version(), "platform": platform.platform(), "sqlite": sqlite3.sqlite_version,
            "cudnn_frontend": cudnn.__version__}  # fmt: skip


def stored_hits(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return int(conn.execute("SELECT coalesce(sum(hit_count), 0) FROM plans").fetchone()[0])


def variant(i: int) -> Any:
    """The i-th of 10,000 distinct conv+bias+relu graphs (batch, channels, height, width)."""
    from graphs import ConvBiasRelu

    if not 0 <= i < 10_000:
        raise ValueError("variant index out of range")
    return ConvBiasRelu(n=1 + i % 10, c=1 + (i // 10) % 10, h=4 + (i // 100) % 10, w=4 + (i // 1000) % 10)


#: Store hits whose Python calls are counted (after the timed ones, never timed themselves).
COUNTED_HITS = 10


def store_indices(entries: int, timed: int, warmup: int) -> tuple[list[int], list[int], list[int]]:
    """Variants looked up by the fresh process: timed ones spread over the store, warm-up
    ones next to them (in the store, never timed), and then those whose calls are counted."""
    step = entries // timed
    if step < 2 or warmup + COUNTED_HITS > timed:
        raise ValueError("the store needs at least twice as many entries as timed lookups")
    return ([k * step for k in range(timed)], [k * step + 1 for k in range(warmup)],
            [k * step + 1 for k in range(warmup, warmup + COUNTED_HITS)])  # fmt: skip


def calls_of(fn: Any) -> tuple[int, set[str]]:
    """The Python calls ``fn()`` makes (``sys.setprofile``'s call events) and the files of
    plancache they run in."""
    calls, files = 0, set()

    def tracer(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1
            name = frame.f_code.co_filename
            if f"plancache{os.sep}" in name:
                files.add(name.rsplit(f"plancache{os.sep}", 1)[1])

    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, files


# ---------------------------------------------------------------------- 1. hits under a held write lock


class _CountingWrites:
    """Wraps the hit-count writer's ``bookkeeping.record_hits`` to see its attempts
    (installed on the module the local tier calls it through, for this phase's process)."""

    def __init__(self, store: Any) -> None:
        from plancache.store import bookkeeping

        self.original = bookkeeping.record_hits
        self.store = store
        self.attempts: list[tuple[int, int, bool]] = []  # (started ns, took ns, written)
        bookkeeping.record_hits = self  # type: ignore[assignment]

    def __call__(self, store: Any, hits: Any, *, wait: bool = True) -> bool:
        if store is not self.store:
            return self.original(store, hits, wait=wait)
        started = time.perf_counter_ns()
        written = False
        try:
            written = self.original(store, hits, wait=wait)
            return written
        finally:
            self.attempts.append((started, time.perf_counter_ns() - started, written))


def bench_lock(workdir: Path, sizes: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    import graphs

    import plancache.tiers.local as local_tier
    from plancache import PlanCache
    from plancache.testing import CpuTestBackend

    directory = workdir / "lock"
    specs = [graphs.ConvBiasRelu(), graphs.MatmulBiasRelu(), graphs.CausalSdpa(),
             dataclasses.replace(graphs.ConvBiasRelu(), n=3)]  # fmt: skip
    fill = PlanCache(directory, backend=CpuTestBackend())
    for spec in specs:
        fill.get(spec.graph())
    fill.close()
    db = directory / "plans.db"
    before = stored_hits(db)

    local_tier.HIT_FLUSH_SECONDS = sizes["flush_s"]  # the writer tries every few tens of ms
    memory_cache = PlanCache(directory, backend=CpuTestBackend())
    store_cache = PlanCache(directory, backend=CpuTestBackend(), max_plans=1)  # 4 keys cycled: every get a store hit
    writes = [_CountingWrites(memory_cache.store), _CountingWrites(store_cache.store)]
    memory_graph = specs[0].graph()
    store_graphs = [spec.graph() for spec in specs]
    lookups = 0
    for i in range(40):  # warm-up; starts both hit-count writers
        memory_cache.get(memory_graph)
        store_cache.get(store_graphs[i % len(store_graphs)])
        lookups += 2
    counters_before = dict(memory_cache.counters), dict(store_cache.counters)

    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db), str(sizes["lock_hold_s"])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "locked":
            raise BenchError(f"the lock holder failed: {holder.communicate()[1][-2000:]}")
        gc.collect()
        memory_ns: list[int] = []
        store_ns: list[int] = []
        clock = time.perf_counter_ns
        window_start = clock()
        end = window_start + int(sizes["lock_loop_s"] * 1e9)
        i = 0
        with benchlib.GcPauses() as gc_pauses:
            while clock() < end:
                t0 = clock()
                memory_cache.get(memory_graph)
                t1 = clock()
                store_cache.get(store_graphs[i % len(store_graphs)])
                t2 = clock()
                memory_ns.append(t1 - t0)
                store_ns.append(t2 - t1)
                i += 1
        window_end = clock()
        held_throughout = holder.poll() is None
        out, err = holder.communicate(timeout=sizes["lock_hold_s"] + 30)  # closes its stdin: it lets go at once
        if holder.returncode != 0 or "released" not in out:
            raise BenchError(f"the lock holder failed: {err[-2000:]}")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    lookups += 2 * len(memory_ns)
    if not held_throughout:
        raise BenchError("the write lock was released before the hits were done: raise lock_hold_s")
    memory_served = memory_cache.counters["memory_hits"] - counters_before[0]["memory_hits"]
    store_served = store_cache.counters["hits"] - counters_before[1]["hits"]
    if memory_served != len(memory_ns) or store_served != len(store_ns):
        raise BenchError(f"hits came from the wrong tier: {memory_served} memory hits of {len(memory_ns)}, "
                         f"{store_served} store hits of {len(store_ns)}")  # fmt: skip

    during = [(took, ok) for w in writes for started, took, ok in w.attempts if window_start <= started < window_end]
    # Hit counts kept: flush after the lock is gone, and the store's total grows by every hit.
    memory_cache.flush()
    store_cache.flush()
    deadline = time.monotonic() + 10
    written = stored_hits(db) - before
    while written < lookups and time.monotonic() < deadline:  # a writer may be mid-commit
        time.sleep(0.02)
        written = stored_hits(db) - before
    memory_cache.close()
    store_cache.close()
    local_tier.HIT_FLUSH_SECONDS = 30.0
    if written != lookups:
        raise BenchError(f"hit counts were lost: the store gained {written} of {lookups}")
    ms = lambda ns: ns / 1e6  # noqa: E731
    return {
        "lock_hold_s": sizes["lock_hold_s"],
        "lock_memory_hit_worst_ms": ms(max(memory_ns)),
        "lock_memory_hit_p99_ms": ms(pct(memory_ns, 0.99)),
        "lock_memory_hit_p50_ms": ms(statistics.median(memory_ns)),
        "lock_memory_hit_count": len(memory_ns),
        "lock_store_hit_worst_ms": ms(max(store_ns)),
        "lock_store_hit_p99_ms": ms(pct(store_ns, 0.99)),
        "lock_store_hit_p50_ms": ms(statistics.median(store_ns)),
        "lock_store_hit_count": len(store_ns),
        "lock_worst_ms": ms(max(max(memory_ns), max(store_ns))),
        "lock_flush_attempts": len(during),
        "lock_flush_refused": sum(1 for _took, ok in during if not ok),
        "lock_flush_worst_ms": ms(max((took for took, _ok in during), default=0)),
        "lock_hit_counts_written": written,
        "lock_hit_counts_expected": lookups,
        **gc_pauses.figures("lock"),
    }


# ---------------------------------------------------------------------- 2. get(graph) repeat


def bench_get(cache: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    from graphs import ConvBiasRelu

    from plancache import describe, make_key
    from plancache.key import canonical_json

    spec = ConvBiasRelu()
    first = cache.get(spec.graph())  # a miss: built and stored, then loaded in memory
    if first.source != "built":
        raise BenchError(f"expected a fresh cache to build the plan, got {first.source}")
    environment, options = cache.environment, cache.options
    environment_json = canonical_json(environment)  # encoded once per environment, as a lookup's key is
    same = spec.graph()
    slot = (first.key, cache.lookup.backend.current_device())
    memory = cache.lookup.memory
    for g in [spec.graph() for _ in range(sizes["get_warmup"])]:
        make_key(describe(g), environment, options)
        cache.get(g)
        cache.get(same)
    hits_before = cache.counters["memory_hits"]
    # Graphs built before timing (only get, describe, make_key are timed). Each part is
    # timed in a loop of its own, in rounds taken in turn, so noise touches them alike.
    rounds = 10
    per_round = max(1, sizes["get_n"] // rounds)
    graphs = [spec.graph() for _ in range(rounds * per_round)]
    to_describe = [spec.graph() for _ in range(rounds * per_round)]
    clock = time.perf_counter_ns
    gc.collect()
    same_ns: list[int] = []
    memory_ns: list[int] = []
    get_ns: list[int] = []
    describe_ns: list[int] = []
    key_ns: list[int] = []
    for r in range(rounds):
        for _ in range(per_round):
            t0 = clock()
            cache.get(same)
            same_ns.append(clock() - t0)
        for _ in range(per_round):
            t0 = clock()
            memory.get(slot)
            memory_ns.append(clock() - t0)
        for g in graphs[r * per_round : (r + 1) * per_round]:
            t0 = clock()
            cache.get(g)
            get_ns.append(clock() - t0)
        descriptions = []
        for g in to_describe[r * per_round : (r + 1) * per_round]:
            t0 = clock()
            d = describe(g)
            describe_ns.append(clock() - t0)
            descriptions.append(d)
        for d in descriptions:
            t0 = clock()
            make_key(d, environment, options, environment_json=environment_json)
            key_ns.append(clock() - t0)
    if cache.counters["memory_hits"] - hits_before != len(graphs) + len(same_ns) or cache.counters["misses"] != 1:
        raise BenchError(f"get repeat was not all memory hits: {cache.counters}")
    us = lambda ns: ns / 1e3  # noqa: E731
    figures = {
        "get_repeat_median_us": us(statistics.median(same_ns)),
        "get_repeat_p90_us": us(pct(same_ns, 0.9)),
        "get_repeat_count": len(same_ns),
        "memory_tier_median_us": us(statistics.median(memory_ns)),
        "memory_tier_p90_us": us(pct(memory_ns, 0.9)),
        "get_fresh_median_us": us(statistics.median(get_ns)),
        "get_fresh_p90_us": us(pct(get_ns, 0.9)),
        "get_fresh_count": len(get_ns),
        "describe_median_us": us(statistics.median(describe_ns)),
        "describe_p90_us": us(pct(describe_ns, 0.9)),
        "make_key_median_us": us(statistics.median(key_ns)),
        "make_key_p90_us": us(pct(key_ns, 0.9)),
    }
    figures["describe_and_key_median_us"] = figures["describe_median_us"] + figures["make_key_median_us"]
    return figures


# ---------------------------------------------------------------------- 3. @cache.builder repeat


def bench_builder(cache: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    from graphs import ConvBiasRelu

    spec = ConvBiasRelu()
    pack = spec.tensors()
    x, w, b, y = (pack[uid] for uid in spec.uids)

    @cache.builder
    def conv(x: Any, w: Any, b: Any, y: Any) -> Any:
        return spec.graph()

    conv(x, w, b, y)  # the signature is seen (its plan comes from the memory tier)
    built = len(conv.plans)
    batch = sizes["builder_batch"]
    for _ in range(batch):  # warm-up
        conv(x, w, b, y)
    clock = time.perf_counter_ns
    gc.collect()
    per_call = []
    for _ in range(sizes["builder_batches"]):
        t0 = clock()
        for _ in range(batch):
            conv(x, w, b, y)
        per_call.append((clock() - t0) / batch / 1e3)
    if len(conv.plans) != built or built != 1:
        raise BenchError("the builder's repeat calls did not all reuse the signature's plan")
    return {"builder_repeat_median_us": statistics.median(per_call), "builder_repeat_p90_us": pct(per_call, 0.9),
            "builder_repeat_calls": batch * sizes["builder_batches"]}  # fmt: skip


# ---------------------------------------------------------------------- 4. fresh-process store hits


def fill_store(directory: Path, entries: int) -> dict[str, Any]:
    """``entries`` servable CPU-backend rows, one per conv+bias+relu variant: variant 0 is
    built by a real miss; the others are written with ``Store.put`` exactly as that miss
    wrote its row (same description, key, tensor table, blob format, engine), which is
    checked on variant 0 byte for byte."""
    from plancache import PlanCache, describe, make_key
    from plancache.key import environment_id, tensor_table
    from plancache.store import Entry, sha256, summarize
    from plancache.testing import CpuTestBackend

    started = time.perf_counter()
    backend = CpuTestBackend()
    cache = PlanCache(directory, backend=backend)
    built = cache.get(variant(0).graph())
    reference = cache.store.get(built.key)
    engine = built.engine
    environment, options = backend.environment(0), cache.options

    def entry(i: int) -> Any:
        graph = variant(i).graph()
        description = describe(graph)
        key = make_key(description, environment, options)
        plan = backend.make_plan(description, tensor_table(graph), engine, backend.behaviour(engine.engine_id))
        now = time.time()
        return Entry(
            key=key.digest, env_id=environment_id(environment), label=summarize(description), description=key.parts["graph"],
            environment=key.parts["environment"], options=key.parts["options"], tensors=[t.to_dict() for t in plan.tensors],
            blob=plan.blob, blob_sha256=sha256(plan.blob), engine=engine.to_dict(), workspace_size=plan.workspace_size,
            policy=reference.policy, candidates=reference.candidates, timing=reference.timing, build_seconds=0.0,
            autotune_seconds=0.0, backend=backend.name, created_at=now, last_used_at=now, check=reference.check,
        )  # fmt: skip

    same = entry(0)
    fields = ("key", "env_id", "label", "description", "environment", "options", "tensors", "blob", "blob_sha256", "engine",
              "workspace_size", "backend")  # fmt: skip
    differ = [f for f in fields if getattr(same, f) != getattr(reference, f)]
    if differ:
        raise BenchError(f"a row written for the store differs from the built one in {differ}")
    store = cache.store
    for i in range(1, entries):
        store.put(entry(i))
    count = store.stats()["entries"]
    cache.close()
    if count != entries:
        raise BenchError(f"the store holds {count} entries, not {entries}")
    return {"store_entries": count, "store_fill_s": time.perf_counter() - started}


def phase_store_hits(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the first lookup of each of ``timed`` keys (store hits)."""
    import cudnn  # noqa: F401 - imported by every caller alike: not part of a lookup

    from plancache import PlanCache
    from plancache.testing import CpuTestBackend

    timed, warmup, counted = store_indices(args["entries"], args["timed"], args["warmup"])
    cache = PlanCache(args["dir"], backend=CpuTestBackend())
    cache.environment  # noqa: B018 - reading the environment is not part of a lookup
    warm = [variant(i).graph() for i in warmup]
    graphs = [variant(i).graph() for i in timed]  # built before timing: only get is timed
    for g in warm:
        cache.get(g)
    speed = calibrate()
    clock = time.perf_counter_ns
    gc.collect()
    ns, sources = [], {}
    collected: list[int] = []  # lookups during which the garbage collector ran
    plan = None
    with benchlib.GcPauses() as gc_pauses:
        passes = gc_pauses.pauses
        for g in graphs:
            seen = len(passes)
            t0 = clock()
            plan = cache.get(g)
            ns.append(clock() - t0)
            sources[plan.source] = sources.get(plan.source, 0) + 1
            if len(passes) != seen:
                collected.append(len(ns) - 1)
    calls, files = [], set()
    for i in counted:  # after the timed hits: counting slows each call
        graph = variant(i).graph()
        made, ran_in = calls_of(lambda graph=graph: cache.get(graph))
        calls.append(made)
        files |= ran_in
    counters = dict(cache.counters)
    # The last plan served runs and matches PyTorch: the rows are servable, not just readable.
    spec = variant(timed[-1])
    pack = spec.tensors()
    assert plan is not None
    plan.execute(pack)
    expected = spec.reference(pack)
    error = float((pack[spec.uids[-1]].float() - expected).norm() / expected.norm().clamp_min(1e-12))
    cache.close()
    return {
        "ns": ns,
        "sources": sources,
        "counters": counters,
        "rel_error": error,
        "calls": calls,
        "files": sorted(files),
        "gc": gc_pauses.figures("store"),
        "collected": collected,
        "speed": speed,
    }


def bench_store_hits(workdir: Path, sizes: dict[str, Any]) -> dict[str, Any]:
    directory = workdir / "store"
    figures = fill_store(directory, sizes["store_entries"])
    phase = {"dir": str(directory), "entries": sizes["store_entries"], "timed": sizes["store_timed"],
             "warmup": sizes["store_warmup"]}  # fmt: skip
    result = _store_hits(benchlib.run_phase(__file__, "store_hits", **phase), sizes)
    # A second fresh process: the first kept the judgement of each row it hit (at its close).
    kept = _store_hits(benchlib.run_phase(__file__, "store_hits", **phase), sizes)
    return {**figures, **_store_figures(result, ""), **_store_figures(kept, "kept_")}


def _store_hits(result: dict[str, Any], sizes: dict[str, Any]) -> dict[str, Any]:
    """``result`` of a store-hits phase, once it is known to be what its label says."""
    ns, counters = result["ns"], result["counters"]
    expected_hits = sizes["store_timed"] + sizes["store_warmup"] + COUNTED_HITS
    if (
        result["sources"] != {"loaded": len(ns)}
        or counters["hits"] != expected_hits
        or counters["memory_hits"]
        or counters["misses"]
    ):
        raise BenchError(f"the fresh process's lookups were not all store hits: {result['sources']}, {counters}")
    if not result["rel_error"] < 1e-4:
        raise BenchError(f"a plan served from the store computed a wrong result (relative error {result['rel_error']})")
    return result


def _store_figures(result: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The figures of one store-hits process; ``prefix`` "kept_" for the process after the first."""
    ns = result["ns"]
    collected = set(result["collected"])
    quiet = [t for i, t in enumerate(ns) if i not in collected] or ns
    figures = {
        "store_hit_p50_ms": statistics.median(ns) / 1e6, "store_hit_p99_ms": pct(ns, 0.99) / 1e6,
        "store_hit_worst_ms": max(ns) / 1e6, "store_hit_count": len(ns),
        "store_hit_p99_without_gc_ms": pct(quiet, 0.99) / 1e6, "store_hit_worst_without_gc_ms": max(quiet) / 1e6,
        "store_hits_with_gc": len(collected), "store_hit_calls": statistics.median(result["calls"]),
        "store_hit_files": len(result["files"]),
    }  # fmt: skip
    figures = {prefix + name: value for name, value in figures.items()}
    if prefix:
        return figures
    return {**figures, "speed_check_store_us": result["speed"], **result["gc"]}


# ---------------------------------------------------------------------- report


def verdict(name: str, figures: dict[str, Any]) -> str:
    limit, unit = TARGETS[name]
    return f"target <= {limit:g} {unit}: " + ("met" if figures[name] <= limit else "MISSED")


def report(header: dict[str, Any], f: dict[str, Any]) -> None:
    print(f"plancache hit benchmark, CPU test backend ({header['date']})")
    print(f"machine: {header['cpus']} CPUs ({header['cpu']}), Python {header['python']}, SQLite {header['sqlite']}, "
          f"cuDNN Frontend {header['cudnn_frontend']}, {header['platform']}")  # fmt: skip
    if header["load_before"] is not None:
        print(f"load average (1 min) before the run: {header['load_before']:.2f}: other work on the machine shifts every figure")
    print("[speed check: us of sum(range(1000)) just before a row; compare runs only where they read alike]")
    w = 66
    print(f"\n1. hits while another process holds the store's write lock ({f['lock_hold_s']:g} s)  "
          f"[{f['speed_check_lock_us']:.1f}]")  # fmt: skip
    for kind, label in (("memory", "memory hit"), ("store", "store hit (read, check, load)")):
        p = f"lock_{kind}_hit_"
        row = f"   {label}: worst / p99 / p50 ms, n={f[p + 'count']}"
        print(f"{row:{w}} {f[p + 'worst_ms']:7.2f} / {f[p + 'p99_ms']:.2f} / {f[p + 'p50_ms']:.3f}")
    print(f"{'   worst of any hit':{w}} {f['lock_worst_ms']:7.2f}   {verdict('lock_worst_ms', f)}")
    print(f"{'   Python GC passes meanwhile: all / full, longest ms':{w}} "
          f"{f['lock_gc_passes']:7d} / {f['lock_gc_full_passes']}, {f['lock_gc_longest_ms']:.2f}")  # fmt: skip
    print(f"{'   hit-count writer during the lock: refused / tries, longest wall ms':{w}} "
          f"{f['lock_flush_refused']:7d} / {f['lock_flush_attempts']}, {f['lock_flush_worst_ms']:.2f}")  # fmt: skip
    print(f"{'   hit counts in the store after the lock: written / hits':{w}} "
          f"{f['lock_hit_counts_written']:7d} / {f['lock_hit_counts_expected']}")  # fmt: skip
    print(f"\n2. cache.get(graph) of a loaded plan, a 3-node conv+bias+relu pygraph (n={f['get_repeat_count']} each)  "
          f"[{f['speed_check_get_us']:.1f}]")  # fmt: skip
    print(f"{'   the same graph object again: median / p90 us':{w}} {f['get_repeat_median_us']:7.1f} / "
          f"{f['get_repeat_p90_us']:.1f}   {verdict('get_repeat_median_us', f)}")  # fmt: skip
    print(f"{'     the memory tier lookup alone: median / p90 us':{w}} {f['memory_tier_median_us']:7.2f} / "
          f"{f['memory_tier_p90_us']:.2f}")  # fmt: skip
    print(f"{'   a fresh graph each call: median / p90 us':{w}} {f['get_fresh_median_us']:7.1f} / {f['get_fresh_p90_us']:.1f}   "
          f"{verdict('get_fresh_median_us', f)}")  # fmt: skip
    print(f"{'     describe(graph) alone: median / p90 us':{w}} {f['describe_median_us']:7.1f} / {f['describe_p90_us']:.1f}")
    print(f"{'     make_key alone: median / p90 us':{w}} {f['make_key_median_us']:7.1f} / {f['make_key_p90_us']:.1f}")
    print(f"{'     describe + make_key (sum of the medians) us':{w}} {f['describe_and_key_median_us']:7.1f}")
    print(f"\n3. @cache.builder call, four torch CPU tensors, a seen signature (n={f['builder_repeat_calls']})  "
          f"[{f['speed_check_builder_us']:.1f}]")  # fmt: skip
    print(f"{'   median / p90 us per call (over batches)':{w}} {f['builder_repeat_median_us']:7.2f} / "
          f"{f['builder_repeat_p90_us']:.2f}   {verdict('builder_repeat_median_us', f)}")  # fmt: skip
    print(f"\n4. fresh process, store of {f['store_entries']:,} entries (filled in {f['store_fill_s']:.1f} s): "
          f"{f['store_hit_count']:,} store hits of distinct keys  [{f['speed_check_store_us']:.1f}]")  # fmt: skip
    print(f"{'   get(graph): p50 ms':{w}} {f['store_hit_p50_ms']:7.3f}   {verdict('store_hit_p50_ms', f)}")
    print(f"{'   get(graph): p99 ms':{w}} {f['store_hit_p99_ms']:7.3f}   {verdict('store_hit_p99_ms', f)}")
    print(f"{'   get(graph): worst ms':{w}} {f['store_hit_worst_ms']:7.3f}")
    print(f"{'   Python calls of a store hit (median of ' + str(COUNTED_HITS) + ') / plancache files they run in':{w}} "
          f"{f['store_hit_calls']:7.0f} / {f['store_hit_files']}")  # fmt: skip
    print(f"{'   the same without the ' + str(f['store_hits_with_gc']) + ' lookups a GC pass fell in: p99 / worst ms':{w}} "
          f"{f['store_hit_p99_without_gc_ms']:7.3f} / {f['store_hit_worst_without_gc_ms']:.3f}")  # fmt: skip
    print(f"{'   Python GC passes meanwhile: all / full, longest ms':{w}} "
          f"{f['store_gc_passes']:7d} / {f['store_gc_full_passes']}, {f['store_gc_longest_ms']:.2f}")  # fmt: skip
    print("   the next fresh process, the first having kept the judgement of each row it hit:")
    print(f"{'   get(graph): p50 / p99 / worst ms':{w}} {f['kept_store_hit_p50_ms']:7.3f} / {f['kept_store_hit_p99_ms']:.3f} / "
          f"{f['kept_store_hit_worst_ms']:.3f}")  # fmt: skip
    print(f"{'   Python calls of a store hit / plancache files they run in':{w}} "
          f"{f['kept_store_hit_calls']:7.0f} / {f['kept_store_hit_files']}")  # fmt: skip


def profile(sizes: dict[str, Any], top: int = 15) -> None:
    """cProfile of the two in-process repeat loops (rows 2 and 3), top entries by own time.
    The profiler slows Python calls more than C ones: read the shares, not the times."""
    import cProfile
    import pstats

    from graphs import ConvBiasRelu

    from plancache import PlanCache
    from plancache.testing import CpuTestBackend

    spec = ConvBiasRelu()
    with tempfile.TemporaryDirectory(prefix="plancache-bench-hits-") as tmp:
        cache = PlanCache(Path(tmp) / "profile", backend=CpuTestBackend())
        cache.get(spec.graph())
        graphs = [spec.graph() for _ in range(sizes["get_n"])]
        pack = spec.tensors()
        x, w, b, y = (pack[uid] for uid in spec.uids)

        @cache.builder
        def conv(x: Any, w: Any, b: Any, y: Any) -> Any:
            return spec.graph()

        conv(x, w, b, y)
        for label, loop in (("get(graph) of the same graph", lambda: [cache.get(graphs[0]) for _ in graphs]),
                            ("get(graph) of a fresh graph", lambda: [cache.get(g) for g in graphs]),
                            ("@cache.builder repeat", lambda: [conv(x, w, b, y) for _ in range(sizes["builder_batch"] * 10)])):  # fmt: skip
            profiler = cProfile.Profile()
            profiler.runcall(loop)
            print(f"\nprofile of the {label} loop, top {top} by own time:")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)
        cache.close()


def run(quick: bool, json_path: str | None, with_profile: bool = False) -> int:
    from plancache import PlanCache
    from plancache.testing import CpuTestBackend

    sizes = QUICK if quick else FULL
    started = time.perf_counter()
    header = machine()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="plancache-bench-hits-") as tmp:
        workdir = Path(tmp)
        try:
            figures["speed_check_lock_us"] = calibrate()
            figures.update(bench_lock(workdir, sizes))
            cache = PlanCache(workdir / "repeat", backend=CpuTestBackend())
            figures["speed_check_get_us"] = calibrate()
            figures.update(bench_get(cache, sizes))
            figures["speed_check_builder_us"] = calibrate()
            figures.update(bench_builder(cache, sizes))
            cache.close()
            figures.update(bench_store_hits(workdir, sizes))
        except BenchError as exc:
            print(f"bench_hits: a run failed: {exc}", file=sys.stderr)
            return 1
    figures["total_s"] = time.perf_counter() - started
    report(header, figures)
    print(f"\n(total {figures['total_s']:.0f} s{', quick sizes' if quick else ''})")
    if with_profile:
        profile(sizes)
    if json_path:
        targets = {name: {"limit": limit, "unit": unit, "met": figures[name] <= limit} for name, (limit, unit) in TARGETS.items()}
        Path(json_path).write_text(
            json.dumps({"header": header, "quick": quick, "figures": figures, "targets": targets}, indent=2)
        )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds): checks the script, not the figures")
    parser.add_argument("--profile", action="store_true", help="then cProfile the get and builder repeat loops")
    parser.add_argument("--phase", choices=["store_hits"], help=argparse.SUPPRESS)
    parser.add_argument("--args", default="{}", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.phase:  # a fresh process started by run_phase: its JSON on the last line
        print(json.dumps(phase_store_hits(json.loads(opts.args))))
        return
    sys.exit(run(opts.quick, opts.json, opts.profile))


if __name__ == "__main__":
    main()
