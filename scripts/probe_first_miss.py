#!/usr/bin/env python3
"""Where a process's first miss goes (GPU): the same lookup as ``bench_startup.py``'s cold
phase (cache environment and cuDNN handle made before), under Python's profiler, then a
second miss of another graph of the same kind, timed plainly, for comparison.

    python scripts/probe_first_miss.py [--rows 30]

Prints the first miss's wall time and the functions that took most of it (cumulative,
then own time); the profiler slows the Python part, so read the shares, not the sum.
A first miss pays what no later miss does (the first use in the process of the engine
family's kernels, of torch's kernels for inputs, references and comparisons): this shows
which calls that is.

``--smoke``: tiny graphs on the CPU test backend; nothing here needs a GPU beyond the graphs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

import benchlib  # noqa: E402 - after the path it is found on

#: The first and second graph: bench_startup's first two, or tiny ones in a smoke run.
GRAPHS = (("conv_bias_act", {"n": 32, "c": 128, "h": 56, "w": 56, "k": 256}),
          ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64}))  # fmt: skip
SMOKE_GRAPHS = (("conv_bias_act", {"n": 1, "c": 8, "h": 6, "w": 6, "k": 8}),
                ("conv_bias_act", {"n": 1, "c": 8, "h": 4, "w": 4, "k": 8}))  # fmt: skip


def probe(directory: Path, rows: int) -> str:
    import plancache
    from plancache.workflows import templates

    torch = benchlib.require_gpu("probe_first_miss")
    cache = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False)
    cache.environment  # noqa: B018 - as bench_startup: device properties and the handle come first
    cache.backend.prepare(cache.backend.current_device())
    (first_name, first), (second_name, second) = SMOKE_GRAPHS if benchlib.smoke() else GRAPHS
    graph = templates.build(first_name, **first)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    cache.get(graph)
    profiler.disable()
    first_ms = (time.perf_counter() - started) * 1e3
    benchlib.synchronize(torch)
    graph = templates.build(second_name, **second)
    started = time.perf_counter()
    cache.get(graph)
    second_ms = (time.perf_counter() - started) * 1e3
    cache.close()
    out = io.StringIO()
    out.write(f"first miss {first_name} {first}: {first_ms:.1f} ms under the profiler\n")
    out.write(f"second miss {second_name} {second}: {second_ms:.1f} ms, not profiled\n")
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(rows)
    stats.sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=30, help="functions shown per ordering (default 30)")
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    benchlib.start_smoke(args.smoke)
    print(probe(benchlib.scratch("plancache-probe-"), args.rows))
    benchlib.report_skipped("probe_first_miss")
    return 0


if __name__ == "__main__":
    sys.exit(main())
