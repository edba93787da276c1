"""Helpers shared by the benchmark scripts: fresh-process phases, GPU timing, smoke runs.

Each benchmark runs every phase in a fresh Python process (``run_phase``), because what a
user pays at start-up only shows in a process that has loaded nothing yet.

Smoke runs (``--smoke``, or ``PLANCACHE_SCRIPT_SMOKE=1``, which child processes inherit): a
script runs at tiny sizes and few repeats on ``plancache.testing.CpuTestBackend``, through
the same code its GPU run takes (``PlanCache.get``, ``Plan.execute``, priming, stats, the
store, its table and JSON), so that the CPU suite (tests/test_script_smoke.py) sees a script
that would crash on a GPU. Phases then run in this process (their results still go through
JSON), timers are host timers, and each part that needs real cuDNN or CUDA sits behind
``gpu_only``, which runs it on a GPU and reports ``skipped: needs a GPU`` in a smoke run.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SMOKE_ENV = "PLANCACHE_SCRIPT_SMOKE"
SKIPPED = "skipped: needs a GPU"
#: What this smoke run skipped (``gpu_only``), printed by ``report_skipped``.
skipped_parts: list[str] = []
_phases: dict[str, dict[str, Any]] = {}  # script file name -> its phases, for a smoke run's in-process phases


def smoke() -> bool:
    """Whether this is a smoke run (``--smoke``, or ``PLANCACHE_SCRIPT_SMOKE=1``)."""
    return os.environ.get(SMOKE_ENV, "").strip() not in ("", "0")


def start_smoke(on: bool) -> bool:
    """Make this a smoke run when ``on`` (a script's ``--smoke``); returns ``smoke()``. Sets
    the variable, so that the script's child processes are smoke runs too."""
    if on:
        os.environ[SMOKE_ENV] = "1"
        skipped_parts.clear()
    return smoke()


def add_smoke_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and few repeats on plancache's CPU test backend "
                        "(no GPU needed): checks that the script runs, measures nothing")  # fmt: skip


def backend() -> Any:
    """The backend of a script's caches: the CPU test backend in a smoke run, else None
    (``PlanCache``'s default: cuDNN)."""
    if not smoke():
        return None
    from plancache.testing import CpuTestBackend

    return CpuTestBackend()


def device() -> str:
    """Where a script's tensors live: the CPU in a smoke run (the CPU test backend runs plans there)."""
    return "cpu" if smoke() else "cuda"


def has_cuda(torch: Any) -> bool:
    """Whether CUDA is used: never in a smoke run."""
    return not smoke() and bool(torch.cuda.is_available())


def synchronize(torch: Any) -> None:
    """``torch.cuda.synchronize()``; nothing to wait for in a smoke run."""
    if has_cuda(torch):
        torch.cuda.synchronize()


def gpu_only(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``fn(*args, **kwargs)``: a part that needs real cuDNN or CUDA. In a smoke run it is not
    called: ``what`` is recorded as skipped, and the result is None."""
    if smoke():
        if what not in skipped_parts:
            skipped_parts.append(what)
        return None
    return fn(*args, **kwargs)


def report_skipped(script: str) -> None:
    """A smoke run's closing lines: each GPU-only part it skipped (nothing outside a smoke run)."""
    if smoke():
        print(f"{script} smoke run: {len(skipped_parts)} GPU-only part(s) {SKIPPED}")
        for what in skipped_parts:
            print(f"  {what}: {SKIPPED}")


def keep_refusal(keep: str | Path) -> str | None:
    """Why a script's ``--keep DIR`` cannot hold its run (None when it can): a file there."""
    where = Path(keep)
    return "is not a directory" if where.exists() and not where.is_dir() else None


def scratch(prefix: str, keep: str | Path | None = None) -> Path:
    """The run's working directory: ``keep`` (a script's ``--keep DIR``, made when new) is
    kept after the run; without it, a new temporary directory removed when the script exits
    (a script's caches and checkpoints are its own: nothing is left in the temporary folder)."""
    if keep is not None:
        root = Path(keep).resolve()
        if (why := keep_refusal(root)) is not None:
            print(f"--keep {keep} {why}: name a new or empty directory", file=sys.stderr)
            sys.exit(2)
        root.mkdir(parents=True, exist_ok=True)
        return root
    root = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """``value * scale`` formatted by ``spec`` (``"9.1f"``), or ``skipped`` in the same width."""
    if value is None:
        width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
        return f"{'skipped':>{width}}"
    return f"{value * scale:{spec}}"


def parse_or_run_phase(description: str, phases: dict[str, Any], argv: Sequence[str] | None = None,
                       script: str | None = None, flags: dict[str, str] | None = None) -> argparse.Namespace | None:  # fmt: skip
    """The command line shared by the benchmarks. With ``--phase``, run that phase here (in
    the fresh process the parent started), print its JSON and return None; else return the
    options of the parent run. ``script``: the benchmark's file, whose phases a smoke run
    then runs in this process (``run_phase``). ``flags``: the script's own on/off options
    and their help."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--phase", choices=sorted(phases))
    parser.add_argument("--args", default="{}")
    parser.add_argument("--out", help="write all figures as JSON here")
    parser.add_argument("--keep", metavar="DIR", help="build the cache in DIR (new or empty) and keep it, to explore with "
                        "`plancache --dir DIR ls`; default: a temporary directory, removed at the end")  # fmt: skip
    add_smoke_option(parser)
    for flag, text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    opts = parser.parse_args(argv)
    start_smoke(opts.smoke)
    if script is not None:
        register_phases(script, phases)
    if opts.phase:
        print(json.dumps(phases[opts.phase](json.loads(opts.args))))
        return None
    return opts


def register_phases(script: str, phases: dict[str, Any]) -> None:
    """The phases of ``script`` (name -> function of its arguments), which a smoke run's
    ``run_phase`` then calls in this process."""
    _phases[Path(script).name] = phases


def run_phase(script: str, phase: str, **args: Any) -> dict[str, Any]:
    """Run ``script --phase PHASE --args JSON`` in a fresh process; its last stdout line is JSON.
    In a smoke run, a phase of a script that registered its phases runs in this process, its
    arguments and result still through JSON."""
    started = time.perf_counter()
    if smoke() and Path(script).name in _phases:
        result: dict[str, Any] = json.loads(json.dumps(_phases[Path(script).name][phase](json.loads(json.dumps(args)))))
        result["process_seconds"] = time.perf_counter() - started
        print(f"  phase {phase:12} done in {result['process_seconds']:.1f} s (smoke run: in this process)", file=sys.stderr)
        return result
    out = subprocess.run(
        [sys.executable, script, "--phase", phase, "--args", json.dumps(args)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"phase {phase} failed with exit code {out.returncode}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - started
    print(f"  phase {phase:12} done in {result['process_seconds']:.1f} s (fresh process)", file=sys.stderr)
    return result


def _host_seconds(fn: Any, calls: int) -> float:
    """Host seconds per call of ``fn`` over ``calls`` calls after one warm-up (a smoke run's
    stand-in for the GPU timers)."""
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def gpu_ms(torch: Any, fn: Any, iters: int = 20, repeats: int = 7) -> float:
    """GPU milliseconds per call: median of ``repeats`` batches of ``iters`` calls, each
    queued behind a GPU sleep so host launch overhead does not pace the kernels. Without
    CUDA (a smoke run): host milliseconds per call over at most 2 calls."""
    if not has_cuda(torch):
        return _host_seconds(fn, min(iters, 2)) * 1e3
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # ~10 ms: the host queues all iters meanwhile
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / iters)
    return statistics.median(times)


def host_us(torch: Any, launch: Any, launches: int = 200, loops: int = 25) -> float:
    """Host microseconds per call of ``launch`` in a tight loop: the median of ``loops``
    loops of ``launches`` calls. Each loop starts on an idle GPU and queues few enough
    launches that the GPU's launch queue (about a thousand entries) never fills, so the
    loop times the host's enqueueing even when the kernels are slower than it. Without
    CUDA (a smoke run): one loop of at most 3 calls."""
    if not has_cuda(torch):
        return _host_seconds(launch, min(launches, 3)) * 1e6
    for _ in range(50):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        started = time.perf_counter()
        for _ in range(launches):
            launch()
        times.append((time.perf_counter() - started) / launches * 1e6)
        torch.cuda.synchronize()  # outside the time: the next loop starts on an idle GPU
    return statistics.median(times)


def rel_error(out: Any, ref: Any) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def require_gpu(what: str) -> Any:
    """torch, once an NVIDIA GPU is known to be there (or this is a smoke run); else exits with one line."""
    import torch

    if not smoke() and not torch.cuda.is_available():
        raise SystemExit(
            f"{what} needs an NVIDIA GPU: it times cuDNN plan builds. Without one, "
            "`python -m pytest` runs the full cache on the CPU test backend "
            f"(and `{what} --smoke` checks that this script runs)."
        )
    return torch


def versions(torch: Any) -> dict[str, Any]:
    import cudnn

    gpu = torch.cuda.get_device_name() if has_cuda(torch) else "none (smoke run on the CPU test backend)"
    cudnn_version = torch.backends.cudnn.version() if has_cuda(torch) else None
    return {"gpu": gpu, "cudnn": cudnn_version, "cudnn_frontend": cudnn.__version__, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def timed(fn: Callable[..., T], took: Callable[[float], None]) -> Callable[..., T]:
    """``fn``, calling ``took(seconds)`` after each call (returned or raised)."""

    def timed_fn(*args: Any, **kwargs: Any) -> T:
        begun = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took(time.perf_counter() - begun)

    return timed_fn


def time_calls(owner: Any, name: str, took: Callable[[float], None]) -> Callable[..., Any]:
    """From now on, ``took(seconds)`` after each call of ``owner.name`` (returned or raised);
    returns what ``owner.name`` was, for a caller that puts it back."""
    original = getattr(owner, name)
    setattr(owner, name, timed(original, took))
    return original


#: The stages of a miss ``MissStages`` times, in the order a miss runs them: keying the graph,
#: the key's build locks, the backend's planning (heuristics), then each candidate set's calls
#: (``CandidateSet``: build, inputs, a candidate's launch and the copy of its outputs, bounds,
#: timing, serialize) and the comparison of each candidate's outputs with the others'
#: (``autotuning.consensus``), then the load back of the stored blob, the judge and the store's write.
MISS_STAGES = ("key", "lock", "planning", "build", "inputs", "launch", "bounds", "compare", "timing", "serialize",
               "load_back", "judge", "store_write")  # fmt: skip
_CANDIDATE_STAGES = (("prepare", "inputs"), ("outputs", "launch"), ("bounds", "bounds"), ("time", "timing"),
                     ("finish", "serialize"))  # fmt: skip


class MissStages:
    """Seconds and calls of each stage of a cache's misses (``MISS_STAGES``), by wrapping the
    seams a miss goes through on the cache's own objects (the backend, its candidate sets,
    the lookup's keys, flight, load back, judging and store, and the GPU timing's
    measurements, counting those taken run by run, and the consensus's comparisons): the
    library is not changed, and a store hit passes through only the key and the judge.
    ``take()`` returns what was timed since the last ``take()`` and starts again. Used as a
    context manager: at its end the GPU timing and the comparisons are their module's own
    again (the cache's objects keep their timers, and are not used after)."""

    def __init__(self, cache: Any) -> None:
        import plancache.cudnn.backend as cudnn_backend_module
        from plancache.autotuning.candidates import Candidates
        from plancache.autotuning.consensus import Consensus

        self.seconds: dict[str, float] = dict.fromkeys(MISS_STAGES, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(MISS_STAGES, 0)
        #: Each candidate build: its index, seconds, and whether cuDNN compiles it at run time.
        self.builds: list[tuple[int, float, bool]] = []
        lookup = cache.lookup
        time_calls(lookup, "key_and_names", self._took("key"))
        lookup.flight.hold = self._timed_context(lookup.flight.hold, "lock")
        time_calls(lookup.unstored, "load_back", self._took("load_back"))
        time_calls(lookup.local, "put", self._took("store_write"))
        time_calls(lookup.judging, "judge", self._took("judge"))
        # As is the GPU's timing: how many of its measurements had to be taken run by run.
        self.one_by_one = 0
        self._cudnn_backend, self._event_times = cudnn_backend_module, cudnn_backend_module.event_times

        def event_times(*args: Any, **kwargs: Any) -> Any:
            measured = self._event_times(*args, **kwargs)
            self.one_by_one += measured.one_by_one
            return measured

        cudnn_backend_module.event_times = event_times
        # The comparisons, which the autotuner runs between the candidate set's calls: the
        # class's own method, made its own again at the end (a consensus is made per miss).
        self._consensus, self._add_candidate = Consensus, time_calls(Consensus, "add", self._took("compare"))
        # The candidates' own stages: their class's methods, made its own again at the end.
        self._candidates = Candidates
        self._candidate_methods = {
            method: time_calls(Candidates, method, self._took(stage)) for method, stage in _CANDIDATE_STAGES
        }
        planning = timed(cache.backend.plans, self._took("planning"))

        def plans(*args: Any, **kwargs: Any) -> Any:
            found = planning(*args, **kwargs)
            found.build = self._each_build(found.build, found.compiles)
            return found

        cache.backend.plans = plans

    def _took(self, stage: str) -> Callable[[float], None]:
        """What a timed call of ``stage`` reports its seconds to."""

        def took(seconds: float) -> None:
            self.seconds[stage] += seconds
            self.calls[stage] += 1

        return took

    def _each_build(self, build: Callable[[int], T], compiles: Callable[[int], bool]) -> Callable[[int], T]:
        """``build`` timed as the build stage, with each call's index, seconds and whether
        it compiles at run time kept."""

        def each(index: int) -> T:
            begun = time.perf_counter()
            try:
                return build(index)
            finally:
                seconds = time.perf_counter() - begun
                self._took("build")(seconds)
                self.builds.append((index, seconds, compiles(index)))

        return each

    def _timed_context(self, hold: Callable[..., Any], stage: str) -> Callable[..., Any]:
        """``hold`` (a context manager's factory), its entry and exit timed: the wait for the
        locks and their release, not the build the locks are held for."""

        @contextlib.contextmanager
        def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
            begun = time.perf_counter()
            released: float | None = None
            try:
                with hold(*args, **kwargs) as value:
                    self._took(stage)(time.perf_counter() - begun)
                    try:
                        yield value
                    finally:
                        released = time.perf_counter()
            finally:
                if released is not None:
                    self.seconds[stage] += time.perf_counter() - released

        return timed

    def __enter__(self) -> MissStages:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cudnn_backend.event_times = self._event_times
        self._consensus.add = self._add_candidate  # type: ignore[method-assign]
        for method, original in self._candidate_methods.items():
            setattr(self._candidates, method, original)

    def take(self) -> dict[str, Any]:
        """``{"seconds": {stage: s}, "calls": {stage: n}, "builds": [{index, seconds, compiles}],
        "timed_one_by_one": n}`` since the last ``take()``."""
        taken = {"seconds": dict(self.seconds), "calls": dict(self.calls),
                 "builds": [{"index": i, "seconds": s, "compiles": c} for i, s, c in self.builds],
                 "timed_one_by_one": self.one_by_one}  # fmt: skip
        self.builds, self.one_by_one = [], 0
        self.seconds = dict.fromkeys(MISS_STAGES, 0.0)
        self.calls = dict.fromkeys(MISS_STAGES, 0)
        return taken


def stage_row(stages: dict[str, Any], wall: float) -> str:
    """A miss's stages in milliseconds, the largest first, and what none of them covers;
    then each build of a candidate (``rtc``: compiled at run time)."""
    seconds = stages["seconds"]
    shown = sorted((s for s in seconds if seconds[s] > 0), key=lambda s: -seconds[s])
    parts = [f"{s} {seconds[s] * 1e3:.1f}" + (f" ({stages['calls'][s]}x)" if stages["calls"][s] > 1 else "") for s in shown]
    if stages.get("timed_one_by_one"):  # the host queued slower than the hold lasted: measured again run by run
        parts = [p + f" [{stages['timed_one_by_one']} run by run]" if p.startswith("timing ") else p for p in parts]
    row = ", ".join([*parts, f"other {(wall - sum(seconds.values())) * 1e3:.1f}"])
    builds = stages.get("builds") or []
    if len(builds) > 1 or any(b["compiles"] for b in builds):  # which candidates the builds' time went to
        row += "; builds " + ", ".join(f"#{b['index']} {b['seconds'] * 1e3:.1f}" + (" rtc" if b["compiles"] else "")
                                       for b in builds)  # fmt: skip
    return row


class GcPauses:
    """Python's garbage-collector passes while it is entered (``gc.callbacks``): a long
    lookup that coincides with a full collection is the runtime pausing, not a wait."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, int]] = []  # (generation, ns)
        self._started = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        else:
            self.pauses.append((int(info["generation"]), time.perf_counter_ns() - self._started))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def figures(self, prefix: str) -> dict[str, Any]:
        return {f"{prefix}_gc_passes": len(self.pauses), f"{prefix}_gc_full_passes": sum(1 for g, _ in self.pauses if g == 2),
                f"{prefix}_gc_longest_ms": max((ns for _, ns in self.pauses), default=0) / 1e6}  # fmt: skip
