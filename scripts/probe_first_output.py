#!/usr/bin/env python3
"""Where the example model's first output goes, in one fresh process (GPU): creating the
input, the six lookups, the first and second forward, and PyTorch eager's first forward.

    PLANCACHE_APP=probe python scripts/probe_first_output.py cold DIR      # fills DIR
    PLANCACHE_APP=probe PLANCACHE_AUTO_PRIME=1 python scripts/probe_first_output.py primed DIR
    PLANCACHE_APP=probe python scripts/probe_first_output.py warm DIR

``primed`` waits 2 s after opening the cache (standing in for weight loading). Prints one
JSON line of milliseconds and the cache's counters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]


def timed(torch: Any, fn: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - started) * 1e3


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    import resnet_attention as example
    import torch

    from plancache.workflows import templates

    plans = example.CachedPlans(directory)
    w = example.weights(torch)
    torch.cuda.synchronize()
    if mode == "primed":
        time.sleep(2.0)
    ms: dict[str, float] = {}
    generator = torch.Generator().manual_seed(1)
    x, ms["input"] = timed(torch, lambda: torch.randn(example.N, 64, 56, 56, generator=generator).to(torch.bfloat16).cuda()
                           .to(memory_format=torch.channels_last))  # fmt: skip

    def lookups() -> None:
        for layer, name, params in example.LAYERS:
            plans.plans[layer] = plans.cache.get(templates.build(name, **params))

    _, ms["lookups"] = timed(torch, lookups)
    _, ms["first_forward"] = timed(torch, lambda: example.forward(plans, torch, w, x))
    _, ms["second_forward"] = timed(torch, lambda: example.forward(plans, torch, w, x))
    _, ms["eager_first_forward"] = timed(torch, lambda: example.forward_eager(torch, w, x))
    primer = plans.cache.primer.report if plans.cache.primer is not None else None
    print(json.dumps({"mode": mode, "module_loading": os.environ.get("CUDA_MODULE_LOADING"),
                      **{k: round(v, 2) for k, v in ms.items()}, "primer": primer, "counters": plans.cache.counters}))  # fmt: skip
    plans.cache.close()


if __name__ == "__main__":
    main()
