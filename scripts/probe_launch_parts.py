#!/usr/bin/env python3
"""Host microseconds of the parts of one launch of a loaded plan (GPU), per graph, in one
run: the whole ``Plan.execute`` (native path), its checks, the backend's launch alone,
the native execute with the pointers repeating (its variant pack kept), the frontend's
compiled execute and ``pygraph.execute`` of the same plan deserialized the frontend's way,
one workspace allocation, the pointer list. Loops of 200 launches, median of 25 loops.
Prints one JSON line per graph.

    python scripts/probe_launch_parts.py
    python scripts/probe_launch_parts.py --smoke   # tiny sizes on the CPU test backend: the
                                                   # frontend's and cuDNN's own parts skipped
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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


def parts(torch: Any, cache: Any, plan: Any, tensors: dict[int, Any], handle: Any) -> dict[str, Any]:
    plan.execute(tensors)  # makes the plan's launch function
    entry = cache.store.get(plan.key)
    assert entry is not None, "the plan was stored by the builder cache"
    pack = plan.check(tensors)
    row: dict[str, Any] = {"workspace": plan.workspace_size, "tensors": len(tensors)}
    row["plan_execute"] = host_us(torch, lambda: plan.execute(tensors))
    row["checks"] = host_us(torch, lambda: plan.check(tensors))
    row["launch"] = host_us(torch, lambda: plan._launch(pack))
    row["pointer_list"] = host_us(torch, lambda: [t.data_ptr() for t in pack.values()])
    cudnn_parts = benchlib.gpu_only("cuDNN's and the frontend's own launches, the workspace allocation", _cudnn_parts,
                                    torch, plan, bytes(entry.blob), pack, tensors, handle)  # fmt: skip
    return {**row, **(cudnn_parts or {})}


def _cudnn_parts(torch: Any, plan: Any, blob: bytes, pack: dict[int, Any], tensors: dict[int, Any],
                 handle: Any) -> dict[str, Any]:  # fmt: skip
    """The parts that call cuDNN or the frontend themselves (needs a GPU): the native execute
    with its pointers repeating, the frontend's compiled and ``pygraph`` executes of ``blob``
    deserialized by the frontend into a graph of its own, one workspace allocation."""
    import cudnn

    from plancache.engines.cudnn_backend import _loaded_backend_graph
    from plancache.engines.native import NativePlan

    stream = torch.cuda.current_stream().cuda_stream
    cudnn.set_stream(handle=handle, stream=stream)
    frontend = cudnn.pygraph(handle=handle)  # the same plan, the frontend's way
    frontend.deserialize(blob)
    lowered = _loaded_backend_graph(frontend)
    size = max(plan.workspace_size, 1)
    workspace = torch.empty(size, dtype=torch.uint8, device="cuda")
    pointers = {uid: t.data_ptr() for uid, t in tensors.items()}
    native = plan.native
    row: dict[str, Any] = {"native": isinstance(native, NativePlan)}
    if isinstance(native, NativePlan):
        user = [pack[u].data_ptr() for u in native.user_uids]
        row["native_execute_pointers_repeat"] = host_us(
            torch, lambda: native.launch(user, workspace.data_ptr(), handle.backend_handle, stream)
        )
    if lowered is not None:
        args = (pointers, workspace.data_ptr(), handle.backend_handle, None, None, None)
        row["frontend_compiled_execute"] = host_us(torch, lambda: lowered._execute(*args))
    row["frontend_execute"] = host_us(torch, lambda: frontend.execute(tensors, workspace, handle=handle))
    row["workspace_alloc"] = host_us(torch, lambda: torch.empty(size, dtype=torch.uint8, device=0))
    return row


def _frontend_handle(torch: Any) -> Any:
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    return handle


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    benchlib.add_smoke_option(parser)
    suite = SMOKE_SUITE if benchlib.start_smoke(parser.parse_args(argv).smoke) else SUITE
    import torch

    import plancache
    from plancache.workflows import templates

    directory = tempfile.mkdtemp()
    builder = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False)
    for name, params in suite:
        builder.get(templates.build(name, **params))
    builder.close()
    # a fresh memory tier: the plans are loaded
    cache = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False)
    handle = benchlib.gpu_only("a cuDNN handle on the current stream", _frontend_handle, torch)
    for name, params in suite:
        plan = cache.get(templates.build(name, **params))
        tensors = templates.allocate(name, device=benchlib.device(), **params)
        print(json.dumps({"graph": name, "source": plan.source, **parts(torch, cache, plan, tensors, handle)}), flush=True)
    cache.close()
    benchlib.report_skipped("probe_launch_parts")


if __name__ == "__main__":
    main()
