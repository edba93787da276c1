#!/usr/bin/env python3
"""Many-plan start-up benchmark: what a server with hundreds of shapes pays at every start.

Stores the plans of a few hundred distinct graphs once (convolutions, matmuls and SDPA
forwards, in shapes as a server's buckets are, the heuristic policy, so the cold fill is
quick; every stored plan was checked against the other candidates as any is), then times,
each in fresh processes, alternating rounds:

  warm      plancache's store hits, one after another (auto-prime off): per hit, the
            lookup's wall time and the part of it inside cuDNN's finalize (the C API's
            ``load_plan``; the frontend's ``deserialize`` where a plan falls back to it);
            the rest is plancache's own share (keying the graph, the read, every check, the
            record, the bookkeeping)
  bare      a loop of cuDNN C-API finalizes of the same stored plans and nothing else (the
            plans' records parsed before the loop)
  frontend  a loop of the frontend's own ``deserialize`` of the same blobs (its warm-up
            loads the kernels, which a finalize leaves to the first launch)
  primed    the default: a cache opened with auto-prime loads the plans of the last run on
            its background threads; the time until all are in memory, then the lookups
            (and the same on each of ``PRIMER_THREADS``' counts of primer threads, 4 and 8:
            the loads' time only)

``--profile`` adds two warm processes: one times the stages of a hit's own share
(``STAGES``, unprofiled, and the garbage collector's passes), one runs under ``cProfile``
and prints the functions with the most time of their own. ``--out FILE`` writes every
figure as JSON. ``--smoke`` runs every phase at tiny sizes on the CPU test backend (the
frontend's loop skipped): it checks the script, not the figures. Needs an NVIDIA GPU
otherwise.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import benchlib

REPEATS = 3  # fresh processes per phase
COLD_DEADLINE_S = 150.0  # the cold fill stops starting builds after this (the warm phases use what it stored)
#: The primer's thread counts timed beside its default (``priming.THREADS``), in the same
#: rounds (each adds a fresh process per round: a few seconds).
PRIMER_THREADS = (4, 8)
#: How many of the longest finalizes are listed (the bare loop's, and the primer's on its
#: default threads): an engine family's first load is tens of milliseconds, the rest under one.
SLOWEST = 6
APP = "bench_many_plans"  # the application name every phase records its plans under (PLANCACHE_APP)


def suite(smoke: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, template, params)`` of each graph: distinct shapes of three kinds."""
    if smoke:
        convs = [{"n": n, "c": 8, "h": h, "w": h, "k": 8} for n in (1, 2) for h in (4, 6)]
        matmuls = [{"b": 1, "m": m, "k": 16, "n": 8, "bias": False, "act": None} for m in (8, 16, 24, 32)]
        sdpas = [{"b": 1, "h": 1, "s": s, "d": 16, "causal": False} for s in (8, 16)]
    else:
        convs = [{"n": n, "c": c, "h": h, "w": h, "k": k} for n in (1, 2, 4, 8, 16, 32) for c, k in
                 ((32, 32), (64, 64), (64, 128), (128, 128)) for h in (14, 28, 56)][:72]  # fmt: skip
        matmuls = [{"b": 1, "m": m, "k": k, "n": k, "bias": False, "act": None} for k in (512, 1024, 2048)
                   for m in range(64, 64 * 25, 64)][:72]  # fmt: skip
        sdpas = [{"b": 1, "h": 8, "s": s, "d": d, "causal": False} for d in (64, 128) for s in range(128, 128 * 31, 128)][:60]
    return ([(f"conv {p['n']}x{p['c']}x{p['h']}x{p['w']} k{p['k']}", "conv_bias_act", p) for p in convs]
            + [(f"matmul {p['m']}x{p['k']}x{p['n']}", "matmul_bias_act", p) for p in matmuls]
            + [(f"sdpa s{p['s']} d{p['d']}", "sdpa", p) for p in sdpas])  # fmt: skip


def _graphs(args: dict[str, Any]) -> list[Any]:
    from plancache.workflows import templates

    return [templates.build(name, **params) for _label, name, params in suite(benchlib.smoke())[: args["graphs"]]]


def _cache(args: dict[str, Any], auto_prime: bool) -> Any:
    import plancache

    return plancache.PlanCache(args["dir"], backend=benchlib.backend(), auto_prime=auto_prime,
                               options=plancache.BuildOptions(policy="heuristic"))  # fmt: skip


def _cuda_up(torch: Any) -> None:
    """The program's own first CUDA work (the primer waits for it; no lookup pays it)."""
    if benchlib.has_cuda(torch):
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- child phases


def phase_cold(args: dict[str, Any]) -> dict[str, Any]:
    torch = benchlib.require_gpu("bench_many_plans")
    _cuda_up(torch)
    cache = _cache(args, auto_prime=False)
    started = time.perf_counter()
    sources: dict[str, int] = {}
    for graph in _graphs(args):
        if time.perf_counter() - started > COLD_DEADLINE_S:
            sources["not tried: past the deadline"] = sources.get("not tried: past the deadline", 0) + 1
            continue
        try:
            source = cache.get(graph).source
        except Exception as exc:  # a shape the GPU cannot plan: left out of the warm phases
            source = f"failed: {type(exc).__name__}"
        sources[source] = sources.get(source, 0) + 1
    seconds = time.perf_counter() - started
    stored = cache.store.keys() if cache.store is not None else []
    cache.close()
    return {"seconds": seconds, "sources": sources, "stored": len(stored)}


def _timed_finalizes(cache: Any) -> list[float]:
    """Seconds inside cuDNN per load from now on: the C API's finalize (``load_plan``) and
    the frontend's deserialize where a plan falls back to it."""
    inside: list[float] = []
    benchlib.time_calls(cache.backend.driver.library(), "load_plan", inside.append)
    benchlib.time_calls(cache.backend.driver, "deserialize", inside.append)
    return inside


#: The stages of a store hit timed by ``--profile``'s unprofiled process: (label, module,
#: class, method); each one's time includes what it calls (a load's finalize is taken out).
STAGES = (("describe and key the graph", "plancache.cache.lookup", "Lookup", "key_and_names"),
          ("read the row", "plancache.tiers.local", "LocalTier", "get"),
          ("judge (kept judgement or blob)", "plancache.cache.judging", "Judging", "judge"),
          ("load, cuDNN's finalize left out", "plancache.guest.guest_backend", "GuestBackend", "load"),
          ("make the Plan", "plancache.cache.lookup", "Lookup", "_plan"))  # fmt: skip


def _timed_stages() -> dict[str, float]:
    """Seconds spent in each of ``STAGES`` from now on (wrapping the methods), by label."""
    import importlib

    spent = dict.fromkeys((label for label, *_ in STAGES), 0.0)
    for label, module, cls, name in STAGES:

        def took(seconds: float, label: str = label) -> None:
            spent[label] += seconds

        benchlib.time_calls(getattr(importlib.import_module(module), cls), name, took)
    return spent


def _warm(args: dict[str, Any], profile: cProfile.Profile | None = None, stages: bool = False) -> dict[str, Any]:
    torch = benchlib.require_gpu("bench_many_plans")
    _cuda_up(torch)
    cache = _cache(args, auto_prime=False)
    cache.environment  # noqa: B018 - the device's properties, read once per process: not a lookup's
    cache.backend.prepare(cache.backend.current_device())  # nor is creating the cuDNN handle
    cache.backend.open_libraries()
    graphs = _graphs(args)[: args["stored"]]  # built before timing: only the lookups are timed
    spent = _timed_stages() if stages else {}
    inside = _timed_finalizes(cache)
    walls: list[float] = []
    finalizes: list[float] = []
    sources: dict[str, int] = {}
    if profile is not None:
        profile.enable()
    with benchlib.GcPauses() as gc_pauses:
        for graph in graphs:
            before = len(inside)
            started = time.perf_counter()
            plan = cache.get(graph)
            walls.append(time.perf_counter() - started)
            finalizes.append(sum(inside[before:]))
            sources[plan.source] = sources.get(plan.source, 0) + 1
    if profile is not None:
        profile.disable()
    fallbacks = dict(cache.backend.native_fallbacks)
    cache.close()
    if stages:  # a load's time inside cuDNN is cuDNN's, not the load's own
        spent["load, cuDNN's finalize left out"] -= sum(finalizes)
    return {"walls": walls, "finalizes": finalizes, "sources": sources, "fallbacks": fallbacks,
            "gc_passes": len(gc_pauses.pauses), "gc_seconds": sum(ns for _, ns in gc_pauses.pauses) / 1e9,
            "stages": spent}  # fmt: skip


def phase_warm(args: dict[str, Any]) -> dict[str, Any]:
    return _warm(args)


def phase_stages(args: dict[str, Any]) -> dict[str, Any]:
    """A warm process's lookups, unprofiled, with the time of each of ``STAGES`` per hit."""
    result = _warm(args, stages=True)
    hits = max(1, len(result["walls"]))
    own = sum(result["walls"]) - sum(result["finalizes"])
    rows = [(label, seconds / hits) for label, seconds in result["stages"].items()]
    rows.append(("the rest (claims, guest block, bookkeeping)", own / hits - sum(seconds for _, seconds in rows)))
    rows.append(("  the garbage collector, inside the above", result["gc_seconds"] / hits))
    lines = [f"{seconds * 1e6:10.1f}  {label}" for label, seconds in rows]
    return {"lines": [f"{'us/hit':>10}  stage of a store hit's own share (mean of {hits} hits; "
                      f"{result['gc_passes']} garbage-collector passes)", *lines]}  # fmt: skip


def phase_profile(args: dict[str, Any]) -> dict[str, Any]:
    """A warm process's lookups under cProfile: the functions with the most time of their own."""
    profile = cProfile.Profile()
    result = _warm(args, profile)
    hits = max(1, len(result["walls"]))
    stats = pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
    own = sorted(stats, key=lambda item: -item[1][2])[: args["top"]]
    ours = sorted((item for item in stats if f"plancache{os.sep}" in item[0][0]), key=lambda item: -item[1][3])[: args["top"]]
    lines = [f"{'own us/hit':>10} {'with callees':>12} {'calls/hit':>9}  function (profiled: slower than unprofiled)"]
    for title, rows in (("most time of their own", own), ("plancache's functions, most time with callees", ours)):
        lines.append(f"-- {title}")
        for (path, line, name), (_, calls, alone, total, _callers) in rows:
            where = f"{Path(path).parent.name}/{Path(path).name}:{line}({name})" if line else name
            lines.append(f"{alone / hits * 1e6:10.1f} {total / hits * 1e6:12.1f} {calls / hits:9.1f}  {where}")
    return {"sources": result["sources"], "lines": lines}


def _stored(args: dict[str, Any]) -> list[bytes]:
    """The stored blob of each graph, in the suite's order (read before any timing)."""
    from plancache.store import Store

    cache = _cache(args, auto_prime=False)
    keys = [cache.key(graph).digest for graph in _graphs(args)[: args["stored"]]]
    cache.close()
    store = Store(args["dir"], read_only=True)
    entries = [store.get(key) for key in keys]
    store.close()
    return [bytes(entry.blob) for entry in entries if entry is not None]


def phase_bare(args: dict[str, Any]) -> dict[str, Any]:
    """cuDNN's C-API finalize of each stored plan, one after another, and nothing else."""
    from plancache.guest.native import parse

    torch = benchlib.require_gpu("bench_many_plans")
    _cuda_up(torch)
    blobs = _stored(args)
    cache = _cache(args, auto_prime=False)
    backend = cache.backend
    device = backend.current_device()
    backend.prepare(device)
    representations = [parse(blob).representation for blob in blobs]
    library = backend.driver.library()
    plans, seconds = [], []
    with backend.handles.lease(device) as handle:
        for representation in representations:
            started = time.perf_counter()
            plans.append(library.load_plan(handle.backend_handle, representation))
            seconds.append(time.perf_counter() - started)
    for plan in plans:
        library.destroy(plan)
    cache.close()
    return {"seconds": seconds}


def _frontend_loop(torch: Any, blobs: list[bytes]) -> list[float]:
    import cudnn

    handle = cudnn.create_handle()
    graphs, seconds = [], []
    for blob in blobs:
        started = time.perf_counter()
        graph = cudnn.pygraph(handle=handle)
        graph.deserialize(blob)
        seconds.append(time.perf_counter() - started)
        graphs.append(graph)
    torch.cuda.synchronize()
    return seconds


def phase_frontend(args: dict[str, Any]) -> dict[str, Any]:
    """The frontend's own ``deserialize`` of each stored blob, one after another."""
    torch = benchlib.require_gpu("bench_many_plans")
    _cuda_up(torch)
    blobs = _stored(args)
    return {"seconds": benchlib.gpu_only("frontend: the frontend's own deserialize loop", _frontend_loop, torch, blobs)}


def phase_primed(args: dict[str, Any]) -> dict[str, Any]:
    """The default: the cache opened with auto-prime, after the program's own CUDA start;
    the time until every plan of the last run is in memory, then the lookups."""
    from plancache.cache import priming

    torch = benchlib.require_gpu("bench_many_plans")
    _cuda_up(torch)
    graphs = _graphs(args)[: args["stored"]]
    priming.THREADS = args.get("threads", priming.THREADS)
    opened = time.perf_counter()
    cache = _cache(args, auto_prime=True)
    primer = cache.primer
    if primer is not None:
        primer.join(timeout=600)
    ready = time.perf_counter() - opened
    started = time.perf_counter()
    sources: dict[str, int] = {}
    for graph in graphs:
        plan = cache.get(graph)
        sources[plan.source] = sources.get(plan.source, 0) + 1
    lookups = time.perf_counter() - started
    counters = dict(cache.counters)
    report = dict(primer.report) if primer is not None else {}
    timeline = primer.timeline() if primer is not None else None
    cache.close()
    return {"ready": ready, "loading": _loading(timeline) if timeline else None, "lookups": lookups, "sources": sources,
            "memory_hits": counters["memory_hits"], "primed": report.get("primed", 0),
            "skipped": len(report.get("skipped", {})), "slowest": _slowest_finalizes(timeline) if timeline else []}  # fmt: skip


def _slowest_finalizes(timeline: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The primer's ``SLOWEST`` longest finalizes: (label, start, end), ms from its handle,
    in the order they started: whether an engine family's first load overlapped another's."""
    handle = max((end for _start, end in timeline["handle"].values()), default=0.0)
    spans = [(plan["label"], plan["finalize"]) for plan in timeline["plans"] if "finalize" in plan]
    longest = sorted(spans, key=lambda span: span[1][0] - span[1][1])[:SLOWEST]
    return sorted(((label, (start - handle) * 1e3, (end - handle) * 1e3) for label, (start, end) in longest), key=lambda s: s[1])


def _loading(timeline: dict[str, Any]) -> float | None:
    """Seconds from the primer's cuDNN handle (made once per process, before any load, as
    the bare loop's is made before its timer) to the end of its last load."""
    handles = [end for _start, end in timeline["handle"].values()]
    ends = [span[1] for plan in timeline["plans"] for span in plan.values() if isinstance(span, list)]
    return max(ends) - max(handles) if handles and ends else None


PHASES = {"cold": phase_cold, "warm": phase_warm, "stages": phase_stages, "profile": phase_profile, "bare": phase_bare, "frontend": phase_frontend,
          "primed": phase_primed}  # fmt: skip


# ---------------------------------------------------------------------- parent


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _loading_ms(primed: list[dict[str, Any]]) -> float | None:
    """The median of primed processes' loading times (``_loading``), ms; None if none had one."""
    loadings = [r["loading"] for r in primed if r["loading"] is not None]
    return statistics.median(loadings) * 1e3 if loadings else None


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: dict[str, Any], profile: bool) -> dict[str, Any]:
    cold = benchlib.run_phase(__file__, "cold", **args)
    args = {**args, "stored": cold["stored"]}
    # name -> (phase, its extra arguments)
    runs: dict[str, tuple[str, dict[str, Any]]] = {name: (name, {}) for name in ("warm", "bare", "frontend", "primed")}
    runs.update({f"primed {n}": ("primed", {"threads": n}) for n in PRIMER_THREADS})
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for _ in range(REPEATS):  # alternating, so that a machine's slow spell falls on every phase alike
        for name, (phase, extra) in runs.items():
            rounds[name].append(benchlib.run_phase(__file__, phase, **args, **extra))
    own = [w - f for r in rounds["warm"] for w, f in zip(r["walls"], r["finalizes"])]
    finalize = [f for r in rounds["warm"] for f in r["finalizes"]]
    frontend = [sum(r["seconds"]) for r in rounds["frontend"] if r["seconds"] is not None]
    figures = {
        "graphs": args["graphs"], "stored": cold["stored"], "cold": cold, "repeats": REPEATS,
        "warm_sources": [r["sources"] for r in rounds["warm"]], "fallbacks": [r["fallbacks"] for r in rounds["warm"]],
        "own_per_hit_median_ms": statistics.median(own) * 1e3, "own_per_hit_p90_ms": _pct(own, 0.9) * 1e3,
        "finalize_per_hit_median_ms": statistics.median(finalize) * 1e3,
        "warm_total_ms": statistics.median(sum(r["walls"]) for r in rounds["warm"]) * 1e3,
        "warm_own_total_ms": statistics.median(sum(r["walls"]) - sum(r["finalizes"]) for r in rounds["warm"]) * 1e3,
        "bare_total_ms": statistics.median(sum(r["seconds"]) for r in rounds["bare"]) * 1e3,
        "frontend_total_ms": _ms(statistics.median(frontend)) if frontend else None,
        "primed_ready_ms": statistics.median(r["ready"] for r in rounds["primed"]) * 1e3,
        "primed_loading_ms": _loading_ms(rounds["primed"]),
        "primed_lookups_ms": statistics.median(r["lookups"] for r in rounds["primed"]) * 1e3,
        "primed_sources": [r["sources"] for r in rounds["primed"]],
        "primed_memory_hits": [r["memory_hits"] for r in rounds["primed"]],
        "primed_loading_ms_by_threads": {n: _loading_ms(rounds[f"primed {n}"]) for n in PRIMER_THREADS},
        "bare_slowest": _bare_slowest(rounds["bare"], [label for label, _name, _params in suite(benchlib.smoke())]),
        "primed_slowest": rounds["primed"][-1]["slowest"],
    }  # fmt: skip
    figures["warm_gc_ms"] = statistics.median(r["gc_seconds"] for r in rounds["warm"]) * 1e3
    figures["warm_gc_passes"] = statistics.median(r["gc_passes"] for r in rounds["warm"])
    if profile:
        figures["stages"] = benchlib.run_phase(__file__, "stages", **args)["lines"]
        figures["profile"] = benchlib.run_phase(__file__, "profile", **args, top=30)["lines"]
    return figures


def _bare_slowest(bare: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """The last bare process's ``SLOWEST`` longest finalizes (position, label, ms) and the
    total of the others, ms."""
    seconds = bare[-1]["seconds"]
    order = sorted(range(len(seconds)), key=lambda i: -seconds[i])
    return {"slowest": [(i, labels[i] if i < len(labels) else "?", seconds[i] * 1e3) for i in sorted(order[:SLOWEST])],
            "others": len(order[SLOWEST:]), "others_ms": sum(seconds[i] for i in order[SLOWEST:]) * 1e3}  # fmt: skip


def report(header: dict[str, Any], f: dict[str, Any]) -> None:
    print(f"plancache many-plan start-up benchmark, {header}")
    print(f"stored {f['stored']} of {f['graphs']} graphs cold in {f['cold']['seconds']:.1f} s ({f['cold']['sources']})")
    print(f"store hits one after another (auto-prime off), {f['repeats']} fresh processes; served: {f['warm_sources'][0]}; "
          f"frontend fallbacks: {f['fallbacks'][0] or 'none'}")  # fmt: skip
    print(f"  plancache's own share per hit: median {f['own_per_hit_median_ms']:.3f} ms, p90 {f['own_per_hit_p90_ms']:.3f} ms"
          f" (cuDNN's finalize per hit: median {f['finalize_per_hit_median_ms']:.3f} ms)")  # fmt: skip
    print(
        f"  all {f['stored']} hits: {f['warm_total_ms']:.1f} ms, of which plancache's own {f['warm_own_total_ms']:.1f} ms"
        f" (the garbage collector's {f['warm_gc_passes']:.0f} passes: {f['warm_gc_ms']:.1f} ms)"
    )
    print(f"bare cuDNN finalize loop (C API, nothing else): {f['bare_total_ms']:.1f} ms")
    print(f"frontend deserialize loop: {benchlib.fmt(f['frontend_total_ms'], '.1f')} ms")
    print(f"primed (the default): all in memory {f['primed_ready_ms']:.1f} ms after the cache opened (its cuDNN handle "
          f"and libraries included), the loads {benchlib.fmt(f['primed_loading_ms'], '.1f')} ms after its handle; then "
          f"{f['stored']} lookups {f['primed_lookups_ms']:.1f} ms ({f['primed_memory_hits'][0]} memory hits)")  # fmt: skip
    bare = f["bare_total_ms"]
    primed = (
        f"primed loads / bare finalize: {f['primed_loading_ms'] / bare:.2f}x"
        if f["primed_loading_ms"] is not None
        else f"primed, all in memory from the opening / bare finalize: {f['primed_ready_ms'] / bare:.2f}x"
    )
    print(f"warm / bare finalize: {f['warm_total_ms'] / bare:.2f}x; {primed}"
          + (f"; warm / frontend deserialize: {f['warm_total_ms'] / f['frontend_total_ms']:.2f}x" if f["frontend_total_ms"]
             else ""))  # fmt: skip
    for threads, loading in f["primed_loading_ms_by_threads"].items():
        if loading is None:
            continue
        plural = "s" if threads != 1 else ""
        print(
            f"primed on {threads} thread{plural}: the loads {loading:.1f} ms after its handle, {loading / bare:.2f}x the bare loop"
        )
    slow = f["bare_slowest"]
    print(f"bare loop (its last process), its {len(slow['slowest'])} longest finalizes: "
          + ", ".join(f"#{i} {label} {ms:.1f} ms" for i, label, ms in slow["slowest"])
          + f"; the other {slow['others']}: {slow['others_ms']:.1f} ms in all")  # fmt: skip
    print(f"primed (its last process), its {len(f['primed_slowest'])} longest finalizes, ms from its handle: "
          + ", ".join(f"{label} {start:.1f}-{end:.1f}" for label, start, end in f["primed_slowest"]))  # fmt: skip
    for line in f.get("stages", []):
        print(f"  stages: {line}")
    for line in f.get("profile", []):
        print(f"  profile: {line}")


def main(argv: list[str] | None = None) -> None:
    opts = benchlib.parse_or_run_phase(
        __doc__.splitlines()[0],
        PHASES,
        argv,
        script=__file__,
        flags={"--profile": "also profile one warm process and print where a store hit's own time goes"},
    )
    if opts is None:
        return
    torch = benchlib.require_gpu("bench_many_plans")
    os.environ["PLANCACHE_APP"] = APP  # every phase's plans under one application: what the primed phase primes
    for name in ("PLANCACHE_REDIS_URL", "PLANCACHE_RECORD", "PLANCACHE_DIR", "PLANCACHE_AUTO_PRIME"):
        os.environ.pop(name, None)
    root = benchlib.scratch("plancache-many-", opts.keep)
    graphs = len(suite(benchlib.smoke()))
    figures = run({"dir": str(root / "cache"), "graphs": graphs}, opts.profile)
    header = benchlib.versions(torch)
    report(header, figures)
    benchlib.report_skipped("bench_many_plans")
    if opts.out:
        Path(opts.out).write_text(json.dumps({**header, **figures}, indent=2))


if __name__ == "__main__":
    main()
