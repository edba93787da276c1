#!/usr/bin/env python3
"""What a process's first miss pays for the check's first use of torch's kernels (GPU), and
whether running the check's own code on tiny tensors first, or on a thread beside the
lookup, takes it off the miss.

    python3 scripts/probe_miss_warm.py [--graphs conv_bias_relu,matmul_bias_relu,sdpa_causal]

Each row is a fresh process that makes no tensor of its own before its one lookup, a cold
miss (as ``bench_miss.py``'s ``cold``, its stages by ``benchlib.MissStages``), in one of
three modes, in the order none, before, thread, none, thread per graph:

* ``none``: the lookup alone;
* ``before``: the check's code (``autotuning.inputs``, ``autotuning.bounds``, ``autotuning.consensus``)
  run first on a copy of the graph's description cut to dimensions of at most 4, its time
  printed, then the lookup;
* ``thread``: that run on a thread started with the lookup, on a stream of its own.

``--smoke``: tiny graphs on the CPU test backend, every process in this one; the figures
mean nothing there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

import benchlib  # noqa: E402 - after the path it is found on

MODES = ("none", "before", "thread", "none", "thread")


def tiny(description: dict[str, Any], specs: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """The description and tensor table with every dimension at most 4, the layouts kept."""
    small = copy.deepcopy(description)
    for tensor in (small.get("tensors") or {}).values():
        if isinstance(tensor.get("dim"), list) and isinstance(tensor.get("stride"), list):
            tensor["dim"], tensor["stride"] = shrunk(tensor["dim"], tensor["stride"])
    return small, [dataclasses.replace(s, **dict(zip(("dims", "strides"), shrunk(s.dims, s.strides)))) for s in specs]


def shrunk(dims: Any, strides: Any, cap: int = 4) -> tuple[Any, Any]:
    """Each size at most ``cap``, packed in the same order of strides (the same layout)."""
    small = [min(int(d), cap) for d in dims]
    order = sorted(range(len(small)), key=lambda i: (strides[i], -i))
    packed, step = [0] * len(small), 1
    for i in order:
        packed[i], step = step, step * small[i]
    return type(dims)(small), type(strides)(packed)


def warm(description: dict[str, Any], specs: list[Any], device: str, stream: Any, marks: dict[str, float]) -> None:
    """The check's code on tiny tensors on ``device`` (``stream``: a CUDA stream, or None),
    seconds since its start in ``marks`` after the inputs, the bounds and the comparison."""
    import torch

    from plancache.autotuning.bounds import bounds
    from plancache.autotuning.consensus import compare
    from plancache.autotuning.inputs import materialize, plan_inputs

    started = time.perf_counter()
    small, small_specs = tiny(description, specs)
    plan = plan_inputs(small, small_specs, {})
    if isinstance(plan, str):
        marks["refused"] = 1
        return
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        pack = materialize(plan, torch, device, torch.Generator(device=device).manual_seed(0))
        marks["inputs"] = time.perf_counter() - started
        found = bounds(small, small_specs, pack)
        marks["bounds"] = time.perf_counter() - started
        outputs = {s.uid: pack[s.uid].zero_() for s in small_specs if s.is_output}
        compare(outputs, {uid: out.clone() for uid, out in outputs.items()}, found)
    if stream is not None:
        stream.synchronize()
    marks["all"] = time.perf_counter() - started


def phase_lookup(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: one cold miss of ``args["graph"]`` in ``args["mode"]``."""
    import bench_miss
    import torch

    import plancache
    from plancache.key import describe, tensor_table

    device = benchlib.device()
    if benchlib.has_cuda(torch):
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the CUDA context, and nothing else of torch's
    graph = bench_miss.builders()[args["graph"]]()
    description, specs = describe(graph), tensor_table(graph)
    cache = plancache.PlanCache(args["dir"], backend=benchlib.backend(), auto_prime=False)
    cache.backend.prepare(cache.backend.current_device())
    stream = torch.cuda.Stream(device=device) if benchlib.has_cuda(torch) else None
    row: dict[str, Any] = {"mode": args["mode"], "graph": args["graph"]}
    marks: dict[str, float] = {}
    if args["mode"] == "before":
        warm(description, specs, device, stream, marks)
    thread = threading.Thread(target=warm, args=(description, specs, device, stream, marks)) if args["mode"] == "thread" else None
    with benchlib.MissStages(cache) as stages:
        started = time.perf_counter()
        if thread is not None:
            thread.start()
        plan = cache.get(graph)
        row["lookup_s"] = time.perf_counter() - started
        row["stages"] = stages.take()
    if thread is not None:
        thread.join()
    row["warm"], row["source"] = marks, plan.source
    cache.close()
    return row


PHASES = {"lookup": phase_lookup}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default="conv_bias_relu,matmul_bias_relu,sdpa_causal")
    parser.add_argument("--phase", choices=sorted(PHASES))
    parser.add_argument("--args", default="{}")
    benchlib.add_smoke_option(parser)
    opts = parser.parse_args(argv)
    benchlib.start_smoke(opts.smoke)
    benchlib.register_phases(__file__, PHASES)
    if opts.phase:  # a fresh process started by run_phase: its JSON on the last line
        print(json.dumps(PHASES[opts.phase](json.loads(opts.args)), default=str))
        return 0
    import bench_miss

    names = [n for n in opts.graphs.split(",") if n] if not benchlib.smoke() else list(bench_miss.SMOKE_GRAPHS)
    for name in names:
        for mode in MODES:
            with tempfile.TemporaryDirectory() as directory:
                row = benchlib.run_phase(__file__, "lookup", graph=name, mode=mode, dir=directory)
            marks = {k: round(v * 1e3, 1) for k, v in row["warm"].items()}
            print(f"{name:18} {mode:7} lookup {row['lookup_s'] * 1e3:7.1f} ms  warm {json.dumps(marks)}")
            print(f"{'':26} {benchlib.stage_row(row['stages'], row['lookup_s'])}", flush=True)
    benchlib.report_skipped("probe_miss_warm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
