#!/usr/bin/env python3
"""Host microseconds of the parts of one launch of a loaded plan (GPU), per graph, in one
run: the whole ``Plan.execute`` (native path), its checks, the backend's launch alone,
the native execute with the pointers repeating (its variant pack kept), the frontend's
compiled execute and ``pygraph.execute`` of the same plan deserialized the frontend's way,
one workspace allocation, the pointer list. Loops of 200 launches, median of 25 loops.
Prints one JSON line per graph.

    python scripts/probe_launch_parts.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import host_us

SUITE: list[tuple[str, dict[str, Any]]] = [
    ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64}),
    ("conv_bias_act", {"n": 32, "c": 128, "h": 56, "w": 56, "k": 256}),
    ("matmul_bias_act", {"b": 8, "m": 1024, "k": 1024, "n": 1024, "bias": False, "act": None}),
    ("sdpa", {"b": 4, "h": 16, "s": 1024, "d": 64, "causal": True}),
]


def parts(torch: Any, cudnn: Any, cache: Any, plan: Any, tensors: dict[int, Any], handle: Any) -> dict[str, Any]:
    from plancache.engines.cudnn_backend import _loaded_backend_graph
    from plancache.engines.native import NativePlan

    plan.execute(tensors)  # makes the plan's launch function
    entry = cache.store.get(plan.key)
    frontend = cache.backend._load_through_frontend(entry.blob, torch.cuda.current_device())  # the same plan, the frontend's way
    lowered = _loaded_backend_graph(frontend)
    size = max(plan.workspace_size, 1)
    workspace = torch.empty(size, dtype=torch.uint8, device="cuda")
    pointers = {uid: t.data_ptr() for uid, t in tensors.items()}
    pack = plan.check(tensors)
    native = plan.native
    stream = torch.cuda.current_stream().cuda_stream
    row: dict[str, Any] = {"workspace": plan.workspace_size, "tensors": len(tensors), "native": isinstance(native, NativePlan)}
    row["plan_execute"] = host_us(torch, lambda: plan.execute(tensors))
    row["checks"] = host_us(torch, lambda: plan.check(tensors))
    row["launch"] = host_us(torch, lambda: plan._launch(pack))
    if isinstance(native, NativePlan):
        user = [pack[u].data_ptr() for u in native.user_uids]
        cudnn.set_stream(handle=handle, stream=stream)
        row["native_execute_pointers_repeat"] = host_us(
            torch, lambda: native.launch(user, workspace.data_ptr(), handle.backend_handle, stream)
        )
    if lowered is not None:
        args = (pointers, workspace.data_ptr(), handle.backend_handle, None, None, None)
        row["frontend_compiled_execute"] = host_us(torch, lambda: lowered._execute(*args))
    row["frontend_execute"] = host_us(torch, lambda: frontend.execute(tensors, workspace, handle=handle))
    row["workspace_alloc"] = host_us(torch, lambda: torch.empty(size, dtype=torch.uint8, device=0))
    row["pointer_list"] = host_us(torch, lambda: [t.data_ptr() for t in pack.values()])
    return row


def main() -> None:
    import cudnn
    import torch

    import plancache
    from plancache.workflows import templates

    directory = tempfile.mkdtemp()
    builder = plancache.PlanCache(directory, auto_prime=False)
    for name, params in SUITE:
        builder.get(templates.build(name, **params))
    cache = plancache.PlanCache(directory, auto_prime=False)  # a fresh memory tier: the plans are loaded
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    for name, params in SUITE:
        plan = cache.get(templates.build(name, **params))
        tensors = templates.allocate(name, device="cuda", **params)
        print(json.dumps({"graph": name, **parts(torch, cudnn, cache, plan, tensors, handle)}), flush=True)


if __name__ == "__main__":
    main()
