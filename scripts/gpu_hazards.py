"""Never in the way, on a GPU: plan loads beside the program's own GPU work, in many fresh processes.

    python3 scripts/gpu_hazards.py [--runs 40] [--parallel 8] [--out hazards.json]

A setup process stores the seven plans of the start-up suite under one application name.
Then ``--runs`` fresh processes per case open a ``PlanCache`` with auto-prime on
(``PLANCACHE_AUTO_PRIME=1``), so the seven plans are primed on a background thread while the main thread,
from its first CUDA call on, does one of:

  weights   copies weights to the GPU on the legacy default stream, checking each copy;
  kernels   bf16 matmuls (the first use of cuBLAS) and ``torch.cuda.synchronize()``, timing
            each iteration: during priming against after it (what priming costs the program);
  captures  ``torch.cuda.graph`` captures (global mode) in a loop, replaying and checking each;
  lookups   captures and kernels, while a second thread looks up plans not loaded yet (only
            lookups there: the program's own allocations on a second thread would break its
            global-mode captures with or without plancache).

Each process then runs every plan and compares it with a float32 PyTorch reference. The
parent counts, per case: CUDA errors, invalidated captures, wrong outputs, and how many
plans were primed. The races are timing-dependent (the GIL mostly serializes the threads),
so several processes run at once and every case has many runs. Needs an NVIDIA GPU.

What priming costs the program is told per process as well as pooled: how many of its
iterations fell while the primer ran, and those iterations without each process's first
(the one that sets CUDA and cuBLAS up, slow with or without priming). ``--threads N`` runs
the primer on N threads instead of its default (``priming.THREADS``): the same script with
two and with four tells what more threads cost the program.

``--smoke``: the start-up suite at tiny sizes on the CPU test backend, one run per case,
each child in this process (under the child's environment, its report still through its
file), the main thread's work shrunk to tensors on the CPU; the CUDA-graph captures are
reported as skipped (the lookups case keeps its second thread of lookups).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import benchlib  # noqa: E402
from bench_startup import SMOKE_SUITE, SUITE  # noqa: E402 - the seven graphs of the start-up suite

CASES = ("weights", "kernels", "captures", "lookups")
APP = "gpu-hazards"
TOLERANCE = 2e-2  # bf16 outputs against a float32 reference (relative norm)
MIN_SECONDS = 1.5  # the main thread's work lasts at least this long, and until priming ended
WEIGHTS, WEIGHT_ELEMENTS, MATMUL, LOOKUPS_MATMUL, CAPTURED = 4, 4 << 20, 4096, 2048, 1 << 20  # the main thread's tensors


def _smoke_sizes() -> None:
    """A smoke run's suite and the main thread's work (module globals, read by every child in this process)."""
    global SUITE, MIN_SECONDS, WEIGHTS, WEIGHT_ELEMENTS, MATMUL, LOOKUPS_MATMUL, CAPTURED
    SUITE, MIN_SECONDS = SMOKE_SUITE, 0.05
    WEIGHTS, WEIGHT_ELEMENTS, MATMUL, LOOKUPS_MATMUL, CAPTURED = 2, 1 << 10, 32, 32, 1 << 10


def relative_error(out: Any, ref: Any) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def setup(directory: Path) -> None:
    """Store the suite's plans and record their use under APP (auto-prime off here)."""
    import plancache
    from plancache.workflows import templates

    with plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False, app=APP) as cache:
        for _label, name, params in SUITE:
            cache.get(templates.build(name, **params))
        cache.flush()


def check_plans(cache: Any, torch: Any) -> list[str]:
    """Run every suite plan on fresh inputs; the ones whose output is wrong."""
    from plancache.workflows import templates

    wrong = []
    for label, name, params in SUITE:
        tensors = templates.allocate(name, device=benchlib.device(), seed=3, **params)
        cache.get(templates.build(name, **params)).execute(tensors)
        benchlib.synchronize(torch)
        if relative_error(tensors[4], templates.reference(name, tensors, **params)) > TOLERANCE:
            wrong.append(label)
    return wrong


class Work:
    """The main thread's work of one case, with what went wrong counted."""

    def __init__(self, torch: Any, primer: Any) -> None:
        self.torch = torch
        self.primer = primer
        self.errors: list[str] = []
        self.invalidated = 0
        self.wrong = 0
        self.during: list[float] = []  # iteration seconds while the primer runs
        self.after: list[float] = []

    def priming(self) -> bool:
        return self.primer is not None and self.primer.is_alive()

    def loop(self, step: Any) -> None:
        started = time.perf_counter()
        while self.priming() or time.perf_counter() - started < MIN_SECONDS:
            begun = time.perf_counter()
            busy = self.priming()
            try:
                step()
            except Exception as exc:
                text = f"{type(exc).__name__}: {str(exc)[:300]}"
                if "captur" in text.lower():
                    self.invalidated += 1
                self.errors.append(text)
                if "CUDA" in text or "cuda" in text:
                    return  # the context may be gone: stop, report
            (self.during if busy else self.after).append(time.perf_counter() - begun)
            if time.perf_counter() - started > 60:
                return

    def weights(self) -> None:
        torch = self.torch
        host = [torch.randn(WEIGHT_ELEMENTS) for _ in range(WEIGHTS)]  # 16 MiB each (on a GPU), made before any CUDA call
        sums = [float(h.sum()) for h in host]
        count = [0]

        def step() -> None:
            i = count[0] % len(host)
            count[0] += 1
            device = host[i].to(benchlib.device(), copy=True)  # the legacy default stream
            if abs(float(device.sum()) - sums[i]) > 1e-2 * max(1.0, abs(sums[i])):
                self.wrong += 1

        self.loop(step)

    def kernels(self) -> None:
        torch = self.torch
        x = torch.randn(MATMUL, MATMUL, device=benchlib.device()).to(torch.bfloat16)
        want = (x @ x).float()

        def step() -> None:
            y = x @ x
            benchlib.synchronize(torch)
            if relative_error(y, want) > 1e-3:
                self.wrong += 1

        self.loop(step)

    def captured(self, x: Any) -> None:
        """One ``torch.cuda.graph`` capture (global mode), replayed and checked (needs CUDA)."""
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x * 2 + 1
        graph.replay()
        torch.cuda.synchronize()
        if not bool((y == 3).all()):
            self.wrong += 1

    def captures(self) -> None:
        torch = self.torch
        x = torch.full((CAPTURED,), 1.0, device=benchlib.device())
        benchlib.synchronize(torch)

        def step() -> None:
            benchlib.gpu_only("captures: torch.cuda.graph captures", self.captured, x)

        self.loop(step)

    def lookups(self, cache: Any) -> None:
        from plancache.workflows import templates

        torch = self.torch
        found: list[str] = []

        def second_thread() -> None:
            # Only lookups: the program's own allocations or synchronizations on a second
            # thread would break the main thread's global-mode captures with or without
            # plancache. Each plan is run and checked after the loop (check_plans).
            try:
                for label, name, params in reversed(SUITE):  # the primer goes forward: meet it halfway
                    cache.get(templates.build(name, **params))
                    found.append(label)
            except Exception as exc:
                self.errors.append(f"second thread: {type(exc).__name__}: {str(exc)[:300]}")

        x = torch.full((CAPTURED,), 1.0, device=benchlib.device())
        w = torch.randn(LOOKUPS_MATMUL, LOOKUPS_MATMUL, device=benchlib.device()).to(torch.bfloat16)
        benchlib.synchronize(torch)
        thread = threading.Thread(target=second_thread)
        thread.start()

        def step() -> None:
            benchlib.gpu_only("lookups: torch.cuda.graph captures beside the second thread's lookups", self.captured, x)
            (w @ w).sum()
            benchlib.synchronize(torch)

        self.loop(step)
        thread.join(120)


def child(case: str, out: str, threads: int | None = None) -> None:
    started = time.perf_counter()
    import torch

    import plancache
    from plancache.cache import priming

    if threads is not None:
        priming.THREADS = threads

    cache = plancache.PlanCache(backend=benchlib.backend())  # auto-prime at its default (on)
    primer = cache.primer
    work = Work(torch, primer)
    try:
        if case == "lookups":
            work.lookups(cache)
        else:
            getattr(work, case)()
    except Exception as exc:
        work.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
    if primer is not None:
        primer.join(120)
    wrong_plans: list[str] = []
    try:
        wrong_plans = check_plans(cache, torch)
    except Exception as exc:
        work.errors.append(f"checking the plans: {type(exc).__name__}: {str(exc)[:300]}")
    report = {
        "case": case, "errors": work.errors, "invalidated": work.invalidated, "wrong": work.wrong, "wrong_plans": wrong_plans,
        "primed": primer.report["primed"] if primer is not None else None, "primer_seconds": primer.report["seconds"] if primer else None,
        "skipped": primer.report["skipped"] if primer is not None else None, "during_ms": [1e3 * s for s in work.during],
        "after_ms": [1e3 * s for s in work.after], "counters": dict(cache.counters), "process_s": time.perf_counter() - started,
        "primer_threads": priming.THREADS,
    }  # fmt: skip
    cache.close()
    Path(out).write_text(json.dumps(report))


def run_child(case: str, index: int, directory: Path, work: Path, threads: int | None = None) -> dict[str, Any]:
    out = work / f"{case}-{index}.json"
    env = {**os.environ, "PLANCACHE_DIR": str(directory), "PLANCACHE_APP": APP, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    env.pop("PLANCACHE_AUTO_PRIME", None)  # what is measured: priming at its default, beside the program's work
    if benchlib.smoke():
        return _run_child_here(case, out, env, threads)
    command = [sys.executable, __file__, "--child", case, str(out)] + (["--threads", str(threads)] if threads else [])
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return {
            "case": case,
            "errors": ["the process hung for 240 s"],
            "invalidated": 0,
            "wrong": 0,
            "wrong_plans": [],
            "exit": None,
        }
    try:
        report = json.loads(out.read_text())
    except (OSError, ValueError):
        report = {
            "case": case,
            "errors": [f"exit {done.returncode}: {done.stderr[-600:]}"],
            "invalidated": 0,
            "wrong": 0,
            "wrong_plans": [],
        }
    report["exit"] = done.returncode
    if done.returncode != 0:
        report["errors"].append(f"exit {done.returncode}: {done.stderr[-600:]}")
    return report


def _run_child_here(case: str, out: Path, env: dict[str, str], threads: int | None) -> dict[str, Any]:
    """A smoke run's child: ``child`` in this process under the child's environment
    (restored afterwards), its report read back from its file as the parent reads a child's."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    failure = None
    try:
        child(case, str(out), threads)
    except Exception as exc:
        failure = f"{type(exc).__name__}: {str(exc)[:600]}"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    report: dict[str, Any] = json.loads(out.read_text()) if failure is None else {
        "case": case, "errors": [failure], "invalidated": 0, "wrong": 0, "wrong_plans": []}  # fmt: skip
    report["exit"] = 0 if failure is None else 1
    return report


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    during = [ms for r in reports for ms in r.get("during_ms", [])]
    # Each process's first iteration sets CUDA up (and cuBLAS, for the matmuls): slow with or
    # without priming, and while priming whenever the primer outlasts it.
    later = [ms for r in reports for ms in r.get("during_ms", [])[1:]]
    counts = [len(r["during_ms"]) for r in reports if "during_ms" in r]
    after = [ms for r in reports for ms in r.get("after_ms", [])]
    primed = [r["primed"] for r in reports if r.get("primed") is not None]
    return {
        "runs": len(reports),
        "cuda_errors": sum(1 for r in reports if any("cuda" in e.lower() for e in r.get("errors", []))),
        "failed_runs": sum(1 for r in reports if r.get("errors")),
        "invalidated": sum(r.get("invalidated", 0) for r in reports),
        "wrong": sum(r.get("wrong", 0) for r in reports) + sum(len(r.get("wrong_plans", [])) for r in reports),
        "primed_median": statistics.median(primed) if primed else None,
        "primed_all": sum(1 for p in primed if p == len(SUITE)),
        "iteration_ms_during": (statistics.median(during), max(during)) if during else None,
        "iteration_ms_after": (statistics.median(after), max(after)) if after else None,
        "iteration_ms_during_later": (statistics.median(later), max(later)) if later else None,
        "iterations_during_per_process": statistics.median(counts) if counts else None,
        "errors": sorted({e[:160] for r in reports for e in r.get("errors", [])})[:8],
    }


def _threads(reports: list[dict[str, Any]]) -> str:
    """The primer threads the children ran (one number where all ran alike)."""
    counts = sorted({r["primer_threads"] for r in reports if r.get("primer_threads") is not None})
    return "/".join(map(str, counts)) or "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="fresh processes per case (default 40; 1 with --smoke)")
    parser.add_argument("--parallel", type=int, default=8, help="processes at once (default 8; 1 with --smoke, "
                        "whose children run in this process)")  # fmt: skip
    parser.add_argument("--cases", default=",".join(CASES), help=f"a subset of {','.join(CASES)}")
    parser.add_argument("--out", help="write every run's report and the summary as JSON here")
    parser.add_argument("--threads", type=int, help="the primer's threads (default: plancache's own, priming.THREADS)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    if benchlib.start_smoke(args.smoke):
        _smoke_sizes()
        args.parallel = 1  # each child sets this process's environment while it runs
    args.runs = args.runs or (1 if benchlib.smoke() else 40)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, not {args.threads}")
    if args.child:
        child(*args.child, args.threads)
        return 0
    work = benchlib.scratch("plancache-hazards-")
    directory = work / "cache"
    began = time.perf_counter()
    setup(directory)
    print(f"setup: {len(SUITE)} plans stored under {APP!r} in {time.perf_counter() - began:.1f} s", flush=True)
    cases = [c for c in args.cases.split(",") if c]
    jobs = [(case, i) for i in range(args.runs) for case in cases]  # interleaved: cases share the machine alike
    with ThreadPoolExecutor(args.parallel) as pool:
        reports = list(pool.map(lambda job: run_child(job[0], job[1], directory, work, args.threads), jobs))
    summary = {case: summarize([r for r in reports if r["case"] == case]) for case in cases}
    print(f"\nplan loads beside the program's work: {args.runs} fresh processes per case, {args.parallel} at once, "
          f"{len(SUITE)} plans primed per process on {_threads(reports)} primer thread(s) ({time.perf_counter() - began:.0f} s)")  # fmt: skip
    print(f"{'case':<9} {'runs':>4} {'CUDA err':>8} {'failed':>6} {'invalid':>7} {'wrong':>5} {'all primed':>10}  "
          f"{'iteration ms during priming (median/max)':<42} after")  # fmt: skip
    ok = True
    for case, s in summary.items():
        during = "{:.2f} / {:.1f}".format(*s["iteration_ms_during"]) if s["iteration_ms_during"] else "-"
        after = "{:.2f} / {:.1f}".format(*s["iteration_ms_after"]) if s["iteration_ms_after"] else "-"
        print(f"{case:<9} {s['runs']:>4} {s['cuda_errors']:>8} {s['failed_runs']:>6} {s['invalidated']:>7} {s['wrong']:>5} "
              f"{s['primed_all']:>6}/{s['runs']:<3}  {during:<42} {after}")  # fmt: skip
        if s["iterations_during_per_process"] is not None:
            later = "{:.2f} / {:.1f}".format(*s["iteration_ms_during_later"]) if s["iteration_ms_during_later"] else "-"
            print(f"          per process: {s['iterations_during_per_process']:g} iterations during priming (median); "
                  f"without each one's first (CUDA's set-up): {later} ms (median/max)")  # fmt: skip
        for error in s["errors"]:
            print(f"          {error}")
        ok &= s["cuda_errors"] == 0 and s["failed_runs"] == 0 and s["invalidated"] == 0 and s["wrong"] == 0
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": reports}, indent=1))
    benchlib.report_skipped("gpu_hazards")
    print(f"gpu_hazards: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
