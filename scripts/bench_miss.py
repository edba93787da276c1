"""What a miss costs: a graph's first call with plancache on an empty cache, against the
frontend's own build, and from the store in a fresh process. Needs a GPU.

    python3 scripts/bench_miss.py [--rounds 2] [--graphs conv_bias_relu,sdpa_causal] [--out miss.json]

Every figure is measured in a fresh process (the first use of an engine family loads its
kernels, which a warm process would hide), rounds alternating between the modes:

* ``frontend``: ``graph.build([A, FALLBACK])`` (validate, operation graph, heuristics,
  support check, the first plan that builds), then one ``execute``;
* ``cold``: ``PlanCache.get`` on an empty cache with the default options (autotuning and
  the element-wise check, the store written), then one ``execute``;
* ``warm``: ``PlanCache.get`` from that store in a fresh process, then one ``execute``.

Each figure is the first call: from the graph built in Python to its first output
synchronized; both have their cuDNN handle before the timer starts. For ``cold``, the
lookup's stages are shown too, in milliseconds, the largest first (``benchlib.MissStages``:
keying, the build locks, planning, the candidates' builds, inputs, launches and comparisons,
bounds, timing and serialization, the load back, the judge, the store's write), and what
none of them covers (``other``).

``--smoke``: three tiny graphs, one round, on the CPU test backend, every child in this
process (its result still through JSON); the frontend's own build is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import benchlib  # noqa: E402 - after the path it is found on

GRAPHS = ("conv_bias_relu", "conv_bias_relu_large", "matmul_bias_relu", "matmul_clip", "sdpa_causal", "sdpa_backward", "layernorm",
          "batchnorm_backward")  # fmt: skip


SMOKE_GRAPHS = ("conv_bias_relu", "matmul_bias_relu", "sdpa_causal")


def builders() -> dict[str, Any]:
    from plancache.workflows import templates

    if benchlib.smoke():  # the same kinds of graph at tiny sizes
        return {
            "conv_bias_relu": lambda: templates.build("conv_bias_act", n=1, c=8, h=6, w=6, k=8),
            "matmul_bias_relu": lambda: templates.build("matmul_bias_act", b=1, m=8, n=8, k=16),
            "sdpa_causal": lambda: templates.build("sdpa", b=1, h=1, s=16, d=16, causal=True),
        }
    import gpu_native

    found = dict(gpu_native.CASES)
    found["conv_bias_relu_large"] = lambda: templates.build("conv_bias_act", n=32, c=128, h=56, w=56, k=256)
    return found


def child(mode: str, name: str, cache_dir: str) -> dict[str, Any]:
    import torch

    from plancache.autotuning.inputs import Refusal, materialize, plan_inputs
    from plancache.key import describe, tensor_table

    device = benchlib.device()
    if benchlib.has_cuda(torch):
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the CUDA context, as any program has one before its first graph
    graph = builders()[name]()
    description, specs = describe(graph), tensor_table(graph)
    inputs = plan_inputs(description, specs, {})
    assert not isinstance(inputs, Refusal), inputs
    pack = materialize(inputs, torch, device, torch.Generator(device=device).manual_seed(0))
    benchlib.synchronize(torch)
    row: dict[str, Any] = {"mode": mode, "graph": name}
    if mode == "frontend":
        row["first_call_s"] = benchlib.gpu_only("frontend: the frontend's own build and execute", _frontend_first_call,
                                                torch, graph, pack)  # fmt: skip
        return row
    import plancache

    cache = plancache.PlanCache(cache_dir, backend=benchlib.backend(), auto_prime=False)
    cache.backend.prepare(cache.backend.current_device())  # its cuDNN handle, as the frontend's run has one before its timer
    with benchlib.MissStages(cache) as stages:
        started = time.perf_counter()
        plan = cache.get(graph)
        row["lookup_s"] = time.perf_counter() - started
        plan.execute(pack)
        benchlib.synchronize(torch)
        row["first_call_s"] = time.perf_counter() - started
        row["stages"] = stages.take()
    row["source"] = plan.source
    entry = cache.store.get(plan.key) if cache.store is not None else None
    if entry is not None and mode == "cold":
        row["check"] = entry.check
        row["candidates"] = len(entry.candidates)
        row["statuses"] = dict(sorted(_count(c["status"] for c in entry.candidates).items()))
        row["timing"] = (entry.timing or {}).get("method")
    cache.close()
    return row


def _frontend_first_call(torch: Any, graph: Any, pack: dict[int, Any]) -> float:
    """Seconds of the frontend's own heuristic build and first execute of ``graph`` (needs cuDNN on a GPU)."""
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    started = time.perf_counter()
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
    graph.execute(pack, workspace, handle=handle)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def _count(items: Any) -> dict[str, int]:
    found: dict[str, int] = defaultdict(int)
    for item in items:
        found[item] += 1
    return found


def run_child(mode: str, name: str, cache_dir: str) -> dict[str, Any]:
    if benchlib.smoke():  # in this process, its row through JSON as a child's stdout, a failure a row as there
        try:
            row: dict[str, Any] = json.loads(json.dumps(child(mode, name, cache_dir), default=str))
        except Exception:
            return {"mode": mode, "graph": name, "failure": traceback.format_exc()[-800:]}
        return row
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, name, cache_dir], capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"mode": mode, "graph": name, "failure": (done.stderr or done.stdout)[-800:]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds per graph (default 2; 1 with --smoke)")
    parser.add_argument("--graphs", default=None, help=f"default {','.join(GRAPHS)} (with --smoke {','.join(SMOKE_GRAPHS)})")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    smoke = benchlib.start_smoke(args.smoke)
    args.rounds = args.rounds or (1 if smoke else 2)
    args.graphs = args.graphs or ",".join(SMOKE_GRAPHS if smoke else GRAPHS)
    if args.child is not None:
        print(json.dumps(child(*args.child), default=str))
        return 0
    rows: list[dict[str, Any]] = []
    for name in [g for g in args.graphs.split(",") if g]:
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as cache_dir:
                rows.append(run_child("frontend", name, cache_dir))
                rows.append(run_child("cold", name, cache_dir))
                rows.append(run_child("warm", name, cache_dir))
    print(f"{'graph':22} {'frontend s':>10} {'cold s':>8} {'ratio':>6} {'warm s':>8}  cold: its lookup's stages and candidates")
    worst: float | None = None
    for name in dict.fromkeys(r["graph"] for r in rows):
        mine = [r for r in rows if r["graph"] == name]
        failed = [r for r in mine if "failure" in r]
        if failed:
            print(f"{name:22} FAILED {failed[0]['mode']}: {failed[0]['failure'][-300:]}")
            continue

        def median(mode: str, mine: list[dict[str, Any]] = mine) -> float | None:
            values = [r["first_call_s"] for r in mine if r["mode"] == mode]
            return None if None in values else statistics.median(values)  # None: skipped (a smoke run)

        fe, cold, warm = median("frontend"), median("cold"), median("warm")
        ratio = None if fe is None or cold is None else cold / fe
        worst = ratio if worst is None or (ratio is not None and ratio > worst) else worst
        last = [r for r in mine if r["mode"] == "cold"][-1]
        stages = benchlib.stage_row(last["stages"], last["lookup_s"])
        fmt = benchlib.fmt
        print(f"{name:22} {fmt(fe, '10.3f')} {fmt(cold, '8.3f')} {fmt(ratio, '6.2f')} {fmt(warm, '8.3f')}  ms: {stages}; "
              f"{last.get('statuses')}; warm from {[r.get('source') for r in mine if r['mode'] == 'warm']}")  # fmt: skip
    print(f"bench_miss: worst cold/frontend ratio {benchlib.fmt(worst, '.2f')}")
    benchlib.report_skipped("bench_miss")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
