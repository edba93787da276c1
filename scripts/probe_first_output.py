#!/usr/bin/env python3
"""Where the example model's first output goes, in one fresh process (GPU): creating the
input, the six lookups, the first and second forward, and PyTorch eager's first forward.

    PLANCACHE_APP=probe python scripts/probe_first_output.py cold DIR      # fills DIR
    PLANCACHE_APP=probe PLANCACHE_AUTO_PRIME=1 python scripts/probe_first_output.py primed DIR
    PLANCACHE_APP=probe python scripts/probe_first_output.py warm DIR

``primed`` waits 2 s after opening the cache (standing in for weight loading). Prints one
JSON line of milliseconds and the cache's counters.

``--smoke``: the example model at tiny sizes on the CPU test backend (its ``set_sizes``),
host timers; without a mode, ``cold`` then ``warm`` on one directory (a temporary one
without DIR), each printing its line. Nothing here needs a GPU beyond its timers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "scripts"), str(ROOT)]

import benchlib  # noqa: E402 - after the path it is found on

#: The example model at tiny sizes (as scripts/bench_model.py's smoke run has it).
SMOKE_SIZES = {"n": 1, "c": 8, "hw": 8, "width": 32, "heads": 2}
MODES = ("cold", "primed", "warm")


def timed(torch: Any, fn: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    benchlib.synchronize(torch)
    return out, (time.perf_counter() - started) * 1e3


def probe(mode: str, directory: str) -> dict[str, Any]:
    import resnet_attention as example
    import torch

    from plancache.workflows import templates

    if benchlib.smoke():  # tiny, on the CPU (the CPU test backend runs the plans there)
        example.set_sizes(**SMOKE_SIZES)
        example.DEVICE = "cpu"
    device = benchlib.device()
    plans = example.CachedPlans(directory, backend=benchlib.backend())
    w = example.weights(torch, device=device)
    benchlib.synchronize(torch)
    if mode == "primed":
        time.sleep(0.1 if benchlib.smoke() else 2.0)
    ms: dict[str, float] = {}
    generator = torch.Generator().manual_seed(1)
    n, c, hw = example.N, example.LAYERS[0][2]["c"], example.LAYERS[0][2]["h"]
    x, ms["input"] = timed(torch, lambda: torch.randn(n, c, hw, hw, generator=generator).to(torch.bfloat16).to(device)
                           .to(memory_format=torch.channels_last))  # fmt: skip

    def lookups() -> None:
        for layer, name, params in example.LAYERS:
            plans.plans[layer] = plans.cache.get(templates.build(name, **params))

    _, ms["lookups"] = timed(torch, lookups)
    _, ms["first_forward"] = timed(torch, lambda: example.forward(plans, torch, w, x))
    _, ms["second_forward"] = timed(torch, lambda: example.forward(plans, torch, w, x))
    _, ms["eager_first_forward"] = timed(torch, lambda: example.forward_eager(torch, w, x))
    primer = plans.cache.primer.report if plans.cache.primer is not None else None
    result = {"mode": mode, "module_loading": os.environ.get("CUDA_MODULE_LOADING"),
              **{k: round(v, 2) for k, v in ms.items()}, "primer": primer, "counters": plans.cache.counters}  # fmt: skip
    plans.cache.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=MODES, help="cold, primed or warm (with --smoke, default: cold then warm)")
    parser.add_argument("directory", nargs="?", help="the plan cache directory (with --smoke, default: a temporary one)")
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    smoke = benchlib.start_smoke(args.smoke)
    if not smoke and (args.mode is None or args.directory is None):
        parser.error("give a mode and the plan cache directory")
    directory = args.directory or str(benchlib.scratch("plancache-probe-"))
    for mode in [args.mode] if args.mode else ["cold", "warm"]:
        print(json.dumps(probe(mode, directory), default=str))
    benchlib.report_skipped("probe_first_output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
