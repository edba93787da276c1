#!/usr/bin/env python3
"""Where a fresh process's first plan loads go (GPU), stage by stage, as the primer takes
them: the device's environment, cuDNN's handle, each plan's finalize, then each plan's
first and second launch. Each case runs in fresh processes, the cases taking turns:

- ``alone``: the loads on a thread of their own while the main thread waits;
- ``beside-copy``: the same while the main thread copies 1 GiB from host memory to the GPU
  (what a program loading its weights does at that moment);
- ``beside-host-copy``: the same while the main thread copies 1 GiB within host memory (no
  CUDA call: tells the GPU copy's effect from the host's);
- ``opened-beside-copy``: as ``beside-copy``, with cuDNN's libraries opened before the
  device is set up, through ``dlopen`` called so that the GIL is released;
- ``made-in-init-beside-copy``: as ``opened-beside-copy``, with cuDNN's handle made inside
  torch's CUDA initialization (a call torch runs when it sets CUDA up, on the thread whose
  CUDA work set it up, before that work goes on), when the device's context exists then.

The loads start when the main thread's first CUDA work has set the device up, as the
primer's do. Prints one JSON line per process, then the median of each stage per case;
``--out FILE`` writes them as JSON.

    python scripts/probe_first_load.py [--rounds 4]
    python scripts/probe_first_load.py --smoke   # the CPU test backend: host timers, no copies
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib
from probe_launch_parts import SMOKE_SUITE, SUITE

CASES = ("alone", "beside-copy", "beside-host-copy", "opened-beside-copy", "made-in-init-beside-copy")
COPY_BYTES = 1 << 30


def open_libraries(backend: Any) -> tuple[int, float]:
    """The primer's own first step (``backend.open_libraries``: ``dlopen`` of every cuDNN
    library beside the loaded one, with the GIL released). Returns how many, and seconds."""
    started = time.perf_counter()
    opened = backend.open_libraries()
    return opened, time.perf_counter() - started


def _handle_in_init(torch: Any, backend: Any, row: dict[str, Any]) -> None:
    from plancache.cudnn.library import libcuda

    def made() -> None:
        cuda = libcuda()
        row["context_at_init"] = active = cuda.primary_context_active(0) if cuda is not None else None
        if active:
            started = time.perf_counter()
            backend.prepare(0)
            row["init_handle_ms"] = (time.perf_counter() - started) * 1e3

    torch.cuda._lazy_call(made)


def child(case: str, directory: str, keys: list[str]) -> dict[str, Any]:
    """One fresh process of ``case``: the stages' (start, end) in ms from the device's setup."""
    import torch

    import plancache
    from plancache.key import TensorSpec
    from plancache.workflows import templates

    row: dict[str, Any] = {"case": case}
    cache = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False)  # no CUDA call
    backend, lookup = cache.backend, cache.lookup
    if "opened" in case or "init" in case:
        opened = benchlib.gpu_only("opening cuDNN's libraries", open_libraries, backend)
        if opened is not None:
            row["libraries_opened"], row["open_ms"] = opened[0], opened[1] * 1e3
    entries = [cache.store.get(key) for key in keys]  # host work, before the device (as the primer reads ahead)
    if "init" in case:
        benchlib.gpu_only("a handle made in torch's CUDA initialization", _handle_in_init, torch, backend, row)
    big = torch.ones(COPY_BYTES // 2, dtype=torch.bfloat16) if "copy" in case and benchlib.has_cuda(torch) else None
    started = time.perf_counter()
    torch.zeros(1, device=benchlib.device())  # the program's first CUDA work sets the device up
    benchlib.synchronize(torch)
    ready = time.perf_counter()
    row["first_cuda_work_ms"] = (ready - started) * 1e3
    stages: dict[str, tuple[float, float]] = {}

    def mark(name: str, started: float) -> None:
        stages[name] = ((started - ready) * 1e3, (time.perf_counter() - ready) * 1e3)

    def load() -> None:
        started = time.perf_counter()
        lookup.environment(0)
        mark("environment", started)
        started = time.perf_counter()
        backend.prepare(0)
        mark("handle", started)
        for i, entry in enumerate(entries):
            started = time.perf_counter()
            backend.load(entry.blob, [TensorSpec.from_dict(t) for t in entry.tensors], 0)
            mark(f"finalize {i}", started)

    loader = threading.Thread(target=load)
    loader.start()
    started = time.perf_counter()
    if big is not None and case.endswith("host-copy"):
        big.clone()
        mark("main: host copy", started)
    elif big is not None:
        big.to(benchlib.device())
        torch.cuda.synchronize()
        mark("main: copy to the GPU", started)
    loader.join()
    suite = SMOKE_SUITE if benchlib.smoke() else SUITE
    for i, (name, params) in enumerate(suite):
        plan = cache.get(templates.build(name, **params))  # loaded again: its kernels are not loaded yet
        tensors = templates.allocate(name, device=benchlib.device(), **params)
        for launch in ("first", "second"):
            started = time.perf_counter()
            plan.execute(tensors)
            benchlib.synchronize(torch)
            mark(f"launch {i} {launch}", started)
    cache.close()
    row["stages"] = stages
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    benchlib.add_smoke_option(parser)
    parser.add_argument("--rounds", type=int, default=4, help="fresh processes per case (default 4; 1 with --smoke)")
    parser.add_argument("--out", metavar="FILE", help="write every process's stages and the medians as JSON here")
    parser.add_argument("--child", nargs=3, metavar=("CASE", "DIR", "KEYS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke = benchlib.start_smoke(args.smoke)
    if args.child:
        case, directory, keys = args.child
        print(json.dumps(child(case, directory, keys.split(","))), flush=True)
        return
    benchlib.require_gpu("probe_first_load")
    import plancache
    from plancache.workflows import templates

    directory = benchlib.scratch("plancache-probe-first-load-")
    builder = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False)
    keys = [builder.get(templates.build(name, **params)).key for name, params in (SMOKE_SUITE if smoke else SUITE)]
    builder.close()
    rows = []
    for _ in range(1 if smoke else args.rounds):
        for case in CASES:
            if smoke:  # in this process, on the CPU test backend, with a fresh cache each time
                rows.append(child(case, str(directory), keys))
            else:
                out = subprocess.run([sys.executable, __file__, "--child", case, str(directory), ",".join(keys)],
                                     capture_output=True, text=True, timeout=600)  # fmt: skip
                if out.returncode != 0:
                    sys.stderr.write(out.stderr[-4000:])
                    raise SystemExit(f"probe_first_load: a {case} process failed with exit code {out.returncode}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    medians = summary(rows)
    print("\n".join(report(rows, medians)))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "medians": medians}, indent=2))
    benchlib.report_skipped("probe_first_load")


def report(rows: list[dict[str, Any]], medians: dict[str, dict[str, tuple[float, float]]]) -> list[str]:
    """The medians of each case as lines, with how often the device's context existed
    inside torch's CUDA initialization where a case asked."""
    lines = []
    for case, stages in medians.items():
        mine = [r for r in rows if r["case"] == case]
        lines.append(f"{case} (median of {len(mine)} processes; ms from the device's setup):")
        lines += [f"  {stage:24} {start:8.1f} - {end:8.1f}  ({end - start:7.1f})" for stage, (start, end) in stages.items()]
        asked = [r["context_at_init"] for r in mine if "context_at_init" in r]
        if asked:
            lines.append(f"  the device's context existed inside torch's CUDA initialization in {sum(map(bool, asked))} "
                         f"of {len(asked)} processes (a handle is made there only then)")  # fmt: skip
    return lines


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per case and stage, the median start and end."""
    found: dict[str, dict[str, tuple[float, float]]] = {}
    for case in CASES:
        mine = [r for r in rows if r["case"] == case]
        if not mine:
            continue
        names = list(mine[0]["stages"])
        found[case] = {n: (statistics.median(r["stages"][n][0] for r in mine), statistics.median(r["stages"][n][1] for r in mine))
                       for n in names}  # fmt: skip
        if "open_ms" in mine[0]:
            found[case]["open (before the device)"] = (0.0, statistics.median(r["open_ms"] for r in mine))
        if all("first_cuda_work_ms" in r for r in mine):
            found[case]["the first CUDA work (before the device)"] = (
                0.0,
                statistics.median(r["first_cuda_work_ms"] for r in mine),
            )
        if any("init_handle_ms" in r for r in mine):
            found[case]["handle in CUDA's init"] = (0.0, statistics.median(r.get("init_handle_ms", 0.0) for r in mine))
    return found


if __name__ == "__main__":
    main()
