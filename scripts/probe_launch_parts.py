#!/usr/bin/env python3
"""Host microseconds of the parts of one launch of a loaded plan (GPU), per graph, in one
run: the whole ``Plan.execute`` (native path), the same of the plan loaded on another
thread (as the primer loads it), its checks (with the pointers gathered in the same
pass), the backend's launch alone, the native execute with the pointers
repeating (its variant pack kept), the frontend's compiled execute and ``pygraph.execute``
of the same plan deserialized the frontend's way, one workspace allocation, and the floor
of any check: torch's own reads of what the checks compare (dtype, shape, strides, data
pointer, device), nothing compared. Loops of 200
launches; the parts take turns, 5 loops each per round for 5 rounds, so that the machine's
drift touches them alike; each figure is the median of its 25 loops. Prints one JSON line
per graph, then ``Plan.execute`` against the frontend's compiled execute (median over the
graphs of each, and of their ratio); ``--out FILE`` writes the lines and the summary as JSON.

    python scripts/probe_launch_parts.py
    python scripts/probe_launch_parts.py --smoke   # tiny sizes on the CPU test backend: the
                                                   # frontend's and cuDNN's own parts skipped
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib
from benchlib import host_us

SUITE: list[tuple[str, dict[str, Any]]] = [
    ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64}),
    ("conv_bias_act", {"n": 32, "c": 128, "h": 56, "w": 56, "k": 256}),
    ("matmul_bias_act", {"b": 8, "m": 1024, "k": 1024, "n": 1024, "bias": False, "act": None}),
    ("sdpa", {"b": 4, "h": 16, "s": 1024, "d": 64, "causal": True}),
]
SMOKE_SUITE: list[tuple[str, dict[str, Any]]] = [
    ("conv_bias_act", {"n": 1, "c": 8, "h": 4, "w": 4, "k": 8}),
    ("matmul_bias_act", {"b": 1, "m": 8, "k": 16, "n": 8, "bias": False, "act": None}),
    ("sdpa", {"b": 1, "h": 1, "s": 16, "d": 16, "causal": True}),
]


def interleaved(torch: Any, launches: dict[str, Callable[[], Any]], rounds: int = 5, loops: int = 5) -> dict[str, float]:
    """``host_us`` of each launch, the launches taking turns: ``loops`` loops each per round."""
    times: dict[str, list[float]] = {name: [] for name in launches}
    for _ in range(rounds):
        for name, launch in launches.items():
            times[name].append(host_us(torch, launch, loops=loops))
    return {name: statistics.median(values) for name, values in times.items()}


def parts(torch: Any, cache: Any, plan: Any, tensors: dict[int, Any], handle: Any, elsewhere: Any) -> dict[str, Any]:
    plan.execute(tensors)  # makes the plan's launch function
    entry = cache.store.get(plan.key)
    assert entry is not None, "the plan was stored by the builder cache"
    checked = plan._checked(tensors)
    assert checked is not None, "the tensors fit the plan"
    row: dict[str, Any] = {"workspace": plan.workspace_size, "tensors": len(tensors)}
    launches: dict[str, Callable[[], Any]] = {
        "plan_execute": lambda: plan.execute(tensors),
        "checks": lambda: plan._checked(tensors),
        "tensor_reads": lambda: _reads(tensors),
        "launch": lambda: plan._launch(*checked),
        # the same plan loaded on another thread (as the primer loads it), launched from this one
        "plan_execute_loaded_on_another_thread": lambda: elsewhere.execute(tensors),
    }
    launches.update(benchlib.gpu_only("cuDNN's and the frontend's own launches, the workspace allocation", _cudnn_parts,
                                      torch, plan, bytes(entry.blob), checked, tensors, handle) or {})  # fmt: skip
    row.update(interleaved(torch, launches))
    return row


def _reads(tensors: dict[int, Any]) -> list[tuple[Any, ...]]:
    """What the checks read of each tensor, through torch's own calls, compared with nothing:
    no check of these tensors can cost less."""
    return [(t.dtype, t.shape, t.stride(), t.data_ptr(), t.is_cuda, t.get_device()) for t in tensors.values()]


def _cudnn_parts(torch: Any, plan: Any, blob: bytes, checked: Any, tensors: dict[int, Any],
                 handle: Any) -> dict[str, Callable[[], Any]]:  # fmt: skip
    """The launches that call cuDNN or the frontend themselves (needs a GPU): the native
    execute with its pointers repeating, the frontend's compiled and ``pygraph`` executes of
    ``blob`` deserialized by the frontend into a graph of its own, one workspace allocation."""
    import cudnn

    from plancache.cudnn.backend import _loaded_backend_graph
    from plancache.guest.native import NativePlan

    stream = torch.cuda.current_stream().cuda_stream
    cudnn.set_stream(handle=handle, stream=stream)
    frontend = cudnn.pygraph(handle=handle)  # the same plan, the frontend's way
    frontend.deserialize(blob)
    lowered = _loaded_backend_graph(frontend)
    size = max(plan.workspace_size, 1)
    workspace = torch.empty(size, dtype=torch.uint8, device="cuda")
    pointers = {uid: t.data_ptr() for uid, t in tensors.items()}
    native = plan.native
    found: dict[str, Callable[[], Any]] = {}
    if isinstance(native, NativePlan):
        user = checked[1]
        found["native_execute_pointers_repeat"] = lambda: native.launch(user, workspace.data_ptr(), handle.backend_handle, stream)
    if lowered is not None:
        args = (pointers, workspace.data_ptr(), handle.backend_handle, None, None, None)
        found["frontend_compiled_execute"] = lambda: lowered._execute(*args)
    found["frontend_execute"] = lambda: frontend.execute(tensors, workspace, handle=handle)
    found["workspace_alloc"] = lambda: torch.empty(size, dtype=torch.uint8, device=0)
    return found


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``Plan.execute`` against the frontend's compiled execute, over the graphs that have both."""
    both = [r for r in rows if r.get("frontend_compiled_execute") and r.get("plan_execute")]
    if not both:
        return {"graphs": 0}
    ours = statistics.median(r["plan_execute"] for r in both)
    theirs = statistics.median(r["frontend_compiled_execute"] for r in both)
    ratio = statistics.median(r["plan_execute"] / r["frontend_compiled_execute"] for r in both)
    # What Plan.execute adds to cuDNN's execute beyond torch's own reads of the tensors.
    beyond = statistics.median(r["plan_execute"] - r["tensor_reads"] - r["frontend_compiled_execute"] for r in both)
    return {"graphs": len(both), "plan_execute_median_us": ours, "frontend_compiled_median_us": theirs,
            "ratio_median": ratio, "met": ours <= theirs,
            "checks_median_us": statistics.median(r["checks"] for r in both),
            "tensor_reads_median_us": statistics.median(r["tensor_reads"] for r in both),
            "beyond_reads_median_us": beyond}  # fmt: skip


def _frontend_handle(torch: Any) -> Any:
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    return handle


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    benchlib.add_smoke_option(parser)
    parser.add_argument("--out", metavar="FILE", help="write every row and the summary as JSON here")
    args = parser.parse_args(argv)
    suite = SMOKE_SUITE if benchlib.start_smoke(args.smoke) else SUITE
    import torch

    import plancache
    from plancache.workflows import templates

    directory = benchlib.scratch("plancache-probe-launch-")
    builder = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False)
    for name, params in suite:
        builder.get(templates.build(name, **params))
    builder.close()
    # a fresh memory tier: the plans are loaded
    cache = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False)
    handle = benchlib.gpu_only("a cuDNN handle on the current stream", _frontend_handle, torch)
    rows = []
    for name, params in suite:
        plan = cache.get(templates.build(name, **params))
        tensors = templates.allocate(name, device=benchlib.device(), **params)
        other = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False)
        loader = threading.Thread(target=other.preload, args=([plan.key],))
        loader.start()
        loader.join()
        elsewhere = other.get(templates.build(name, **params))  # a memory hit: the plan the thread loaded
        rows.append({"graph": name, "source": plan.source, **parts(torch, cache, plan, tensors, handle, elsewhere)})
        other.close()
        print(json.dumps(rows[-1]), flush=True)
    cache.close()
    found = summary(rows)
    if found["graphs"]:
        print(f"Plan.execute against the frontend's compiled execute, median over {found['graphs']} graphs: "
              f"{found['plan_execute_median_us']:.1f} us against {found['frontend_compiled_median_us']:.1f} us "
              f"(median ratio {found['ratio_median']:.2f}): target Plan.execute <= the frontend's: "
              f"{'met' if found['met'] else 'MISSED'}")  # fmt: skip
        print(f"of which the checks {found['checks_median_us']:.1f} us, torch's own reads of the tensors they check "
              f"{found['tensor_reads_median_us']:.1f} us; Plan.execute less those reads, against the compiled execute: "
              f"{found['beyond_reads_median_us']:+.1f} us (medians over the graphs)")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "summary": found}, indent=2))
    benchlib.report_skipped("probe_launch_parts")


if __name__ == "__main__":
    main()
