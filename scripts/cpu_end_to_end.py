#!/usr/bin/env python3
"""plancache end to end on the CPU test backend: what `python scripts/bench_startup.py` runs on
a machine without an NVIDIA GPU (or run it directly).

The kinds of graph of the GPU benchmark (fused convolutions, matmuls, attention), at small
sizes, go through ``plancache.PlanCache`` with ``plancache.testing.CpuTestBackend``: real
``cudnn.pygraph`` graphs, keyed and stored exactly as on a GPU, executed by PyTorch on the
CPU. Each phase runs in a fresh process:

  miss     empty cache: describe, key, autotune (the CPU backend's simulated candidates), store
  repeat   the same lookup again in that process: a memory hit (describe and key included)
  hit      a second fresh process: read the entry, check its checksum, load it
  primed   a third fresh process with auto-prime on (the default): the plans the earlier
           runs used load in the background while a pause stands in for loading weights,
           then the same lookups

then each plan's output against the template's PyTorch reference, and the store's figures.
These are CPU-backend times, not cuDNN's: the GPU figures need an NVIDIA GPU.
``--out FILE`` also writes every figure as JSON. ``--keep DIR`` builds the cache in DIR
(new or empty) and keeps it; the run ends by saying how to explore it (``plancache --dir
DIR ls``). Exit code 0 when every plan was built, then loaded from the store, and matched
PyTorch; 2 for a ``--keep`` directory that holds a cache already; 128 + the signal's
number when SIGINT (130), SIGTERM or SIGHUP stops it: one line, no traceback, and the
temporary directory removed.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchlib

TOLERANCE = 2e-2  # bf16
REPEATS = 200  # repeat lookups timed per graph

SUITE: list[tuple[str, str, dict[str, Any]]] = [
    ("conv+bias+relu N2 C16 14x14 K32", "conv_bias_act", {"n": 2, "c": 16, "h": 14, "w": 14, "k": 32}),
    ("conv+bias+relu N1 C8 14x14 K8", "conv_bias_act", {"n": 1, "c": 8, "h": 14, "w": 14, "k": 8}),
    ("conv N2 C32 7x7 K32", "conv_bias_act", {"n": 2, "c": 32, "h": 7, "w": 7, "k": 32, "bias": False, "act": None}),
    ("matmul+bias+relu 2x64x128x64", "matmul_bias_act", {"b": 2, "m": 64, "k": 128, "n": 64}),
    ("matmul 2x128x128x128", "matmul_bias_act", {"b": 2, "m": 128, "k": 128, "n": 128, "bias": False, "act": None}),
    ("SDPA causal b1 h2 s64 d32", "sdpa", {"b": 1, "h": 2, "s": 64, "d": 32, "causal": True}),
    ("SDPA b1 h2 s128 d64", "sdpa", {"b": 1, "h": 2, "s": 128, "d": 64, "causal": False}),
]


PAUSE_S = 0.5  # the primed phase's stand-in for a program loading its weights


def _lookups(directory: str, repeat: bool, auto_prime: bool = False) -> dict[str, Any]:
    import cudnn  # noqa: F401 - imported by every approach alike: not part of a lookup
    import torch  # noqa: F401

    from plancache import PlanCache
    from plancache.testing import CpuTestBackend
    from plancache.workflows import templates

    # Every phase is one run of one application, so the primed phase primes what they used.
    cache = PlanCache(directory, backend=CpuTestBackend(), auto_prime=auto_prime, app="cpu_end_to_end")
    cache.environment  # noqa: B018 - reading the environment is not part of a lookup
    if auto_prime:
        time.sleep(PAUSE_S)
    rows = []
    for _label, name, params in SUITE:
        graph = templates.build(name, **params)
        started = time.perf_counter()
        plan = cache.get(graph)
        row: dict[str, Any] = {"ms": (time.perf_counter() - started) * 1e3, "source": plan.source, "key": plan.key}
        if repeat:
            times = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                cache.get(graph)
                times.append(time.perf_counter() - started)
            row["repeat_us"] = statistics.median(times) * 1e6
        tensors = templates.allocate(name, device="cpu", **params)
        plan.execute(tensors)
        ref = templates.reference(name, tensors, **params)
        row["rel_error"] = float((tensors[4].float() - ref).norm() / ref.norm().clamp_min(1e-12))
        rows.append(row)
    cache.close()
    return {"rows": rows, "counters": cache.counters}


def phase_miss(args: dict[str, Any]) -> dict[str, Any]:
    return _lookups(args["dir"], repeat=True)


def phase_hit(args: dict[str, Any]) -> dict[str, Any]:
    return _lookups(args["dir"], repeat=False)


def phase_primed(args: dict[str, Any]) -> dict[str, Any]:
    return _lookups(args["dir"], repeat=False, auto_prime=True)


PHASES = {"miss": phase_miss, "hit": phase_hit, "primed": phase_primed}


class Stopped(BaseException):
    """A signal that ends the run (SIGINT, SIGTERM, SIGHUP): raised where the run is, so
    that the temporary directory is removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: The signal that stopped the run, once one came. A signal handler's exception raised
#: while the interpreter runs a callback of its own (a weakref's, an import lock's) is
#: printed as "ignored" and the run goes on: ``_check_stopped`` raises it again.
_received: list[int] = []


def _check_stopped() -> None:
    """Raise ``Stopped`` for a signal that came and whose exception was swallowed."""
    if _received:
        raise Stopped(_received[0])


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise ``Stopped`` (SIGTERM and SIGHUP killed the process
    before, leaving its temporary directory); the first one only, so that the clean-up it
    starts is not cut short by a second."""

    def stop(signum: int, _frame: Any) -> None:
        for number in STOPPING:
            signal.signal(number, signal.SIG_IGN)
        _received.append(signum)
        raise Stopped(signum)

    previous = {number: signal.signal(number, stop) for number in STOPPING}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def run(out: str | None = None, keep: str | None = None) -> int:
    """The three phases in fresh processes, then the table; the exit code (0: all as
    expected). The cache lives in ``keep`` (kept), else in a temporary directory removed
    at the end, also when a signal stops the run."""
    if keep is not None:
        what = benchlib.keep_refusal(keep) or ("holds a cache already" if (Path(keep) / "plans.db").exists() else None)
        if what is not None:  # refused before any phase runs
            print(f"cpu_end_to_end: --keep {keep} {what}: name a new or empty directory", file=sys.stderr)
            return 2
    try:
        with _stopped_by_signals():
            if keep is not None:
                code = _run(str(Path(keep).resolve()), out, kept=True)
            else:
                with contextlib.ExitStack() as stack:
                    # The directory is made and its removal registered with the signals held
                    # back: one arriving between the two left the directory behind.
                    signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
                    try:
                        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="plancache-cpu-"))
                    finally:
                        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)
                    code = _run(str(Path(root) / "cache"), out, kept=False)
            _check_stopped()
            return code
    except (Stopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        left = f"the cache in {keep} is kept" if keep is not None else "its temporary directory was removed"
        print(f"cpu_end_to_end: stopped by {signal.Signals(signum).name}; {left}", file=sys.stderr)
        return 128 + signum


def _run(directory: str, out: str | None, *, kept: bool) -> int:
    from plancache.config import format_size
    from plancache.store import Store, maintenance

    print(f"no NVIDIA GPU here: plancache end to end on the CPU test backend, cache {directory}", file=sys.stderr)
    miss = benchlib.run_phase(__file__, "miss", dir=directory)
    _check_stopped()
    hit = benchlib.run_phase(__file__, "hit", dir=directory)
    _check_stopped()
    primed = benchlib.run_phase(__file__, "primed", dir=directory)
    _check_stopped()
    store = Store(directory, read_only=True)
    try:
        stats = store.stats()
        blobs = {row["key"]: row["blob_size"] for row in maintenance.list_entries(store)}
    finally:
        store.close()

    print(f"\nplancache end to end on the CPU test backend: {len(SUITE)} graphs, a miss and {REPEATS} repeat lookups in one "
          f"fresh process, a hit in another, and auto-primed lookups in a third (after a {PAUSE_S} s pause)")  # fmt: skip
    print(
        f"{'graph':34} {'miss ms':>8} {'repeat us':>10} {'fresh-process hit ms':>21} {'primed ms':>10} {'blob':>9} {'rel err':>8}"
    )
    problems = []
    for i, (label, _name, _params) in enumerate(SUITE):
        first, again, third = miss["rows"][i], hit["rows"][i], primed["rows"][i]
        error = max(first["rel_error"], again["rel_error"], third["rel_error"])
        print(f"{label:34} {first['ms']:8.1f} {first['repeat_us']:10.1f} {again['ms']:21.2f} {third['ms']:10.2f} "
              f"{format_size(blobs.get(first['key'], 0)):>9} {error:8.1e}")  # fmt: skip
        sources = (first["source"], again["source"], third["source"])
        if sources != ("built", "loaded", "loaded") or not first["key"] == again["key"] == third["key"]:
            problems.append(f"{label}: got {' then '.join(sources)} (expected built, then loaded twice)")
        if error > TOLERANCE:
            problems.append(f"{label}: output differs from PyTorch")
    totals = [sum(r["ms"] for r in phase["rows"]) for phase in (miss, hit, primed)]
    print(f"{'TOTAL':34} {totals[0]:8.1f} {'':10} {totals[1]:21.2f} {totals[2]:10.2f}")
    if primed["counters"].get("primed") != len(SUITE):
        problems.append(f"auto-prime loaded {primed['counters'].get('primed')} of {len(SUITE)} plans before the lookups")
    print(f"\nstore: {stats['entries']} entries, {format_size(stats['blob_bytes'])} of blobs in a "
          f"{format_size(stats['file_bytes'])} file, {stats['hits']} hits recorded")  # fmt: skip
    counters = lambda c: ", ".join(f"{k} {v}" for k, v in c.items() if v)  # noqa: E731
    print(f"first process:  {counters(miss['counters'])}")
    print(f"second process: {counters(hit['counters'])}")
    print(f"third process:  {counters(primed['counters'])}")
    print("\nThese are CPU-backend times. The GPU figures (cuDNN heuristic builds, autotuning, deserialize,")
    print("execution) need an NVIDIA GPU: on one, `python scripts/bench_startup.py` runs the start-up benchmark.")
    if out:
        Path(out).write_text(
            json.dumps({"suite": [s[0] for s in SUITE], "miss": miss, "hit": hit, "primed": primed, "stats": stats}, indent=2)
        )
    if kept:
        print(f"\nThe cache is kept in {directory}. Explore what it built:")
        for command in ("ls", "stats", "inspect", "show KEY --explain"):
            print(f"  plancache --dir {directory} {command}")
    else:
        print("\nThe cache was temporary and is removed: `python scripts/bench_startup.py --keep DIR` keeps it in DIR, "
              "to explore with `plancache --dir DIR ls`, `inspect` and `show KEY`.")  # fmt: skip
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main() -> None:
    opts = benchlib.parse_or_run_phase(__doc__.splitlines()[0], PHASES)
    if opts is None:
        return
    sys.exit(run(opts.out, keep=opts.keep))


if __name__ == "__main__":
    main()
