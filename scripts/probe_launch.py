#!/usr/bin/env python3
"""Probe (GPU): where the host time of one launch goes, and whether deserialize holds the GIL."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

N = 3000


def per_call_us(fn, n=N, reps=5):
    import torch

    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def launch_probe(directory: str) -> dict:
    import cudnn
    import torch

    import plancache
    from plancache import templates

    cache = plancache.PlanCache(directory)
    res = {}
    for name, params in (("matmul_bias_act", {"b": 1, "m": 64, "k": 64, "n": 64}),
                         ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64})):
        plan = cache.get(templates.build(name, **params))
        t = templates.allocate(name, device="cuda", **params)
        g = plan.native
        h = cudnn.create_handle()
        cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
        ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
        uids = tuple(sorted(t))
        tup = tuple(t[u] for u in uids)
        row = {"workspace": plan.workspace_size}
        row["fe_execute_dict"] = per_call_us(lambda: g.execute(t, ws, handle=h))
        try:
            row["fe_execute_ordered"] = per_call_us(lambda: g.execute(tup, ws, handle=h, tensor_uids=uids))
        except Exception as exc:
            row["fe_execute_ordered"] = repr(exc)[:200]
        lowered = g.__dict__.get("_lowered_graph")
        if lowered is not None:
            try:
                ptrs = {u: x.data_ptr() for u, x in t.items()}
                wsp = ws.data_ptr()
                bh = h.backend_handle
                row["lowered_execute_ptrs"] = per_call_us(lambda: lowered._execute(ptrs, wsp, bh, None, None, None))
                row["lowered_execute_ptrs_with_dataptr"] = per_call_us(
                    lambda: lowered._execute({u: x.data_ptr() for u, x in t.items()}, ws.data_ptr(), bh, None, None, None))
            except Exception as exc:
                row["lowered_execute_ptrs"] = repr(exc)[:300]
        row["plan_execute"] = per_call_us(lambda: plan.execute(t))
        row["plan_check"] = per_call_us(lambda: plan.check(t))
        dev = torch.cuda.current_device()
        size = plan.workspace_size
        row["torch_empty_ws"] = per_call_us(lambda: torch.empty(size, dtype=torch.uint8, device=dev))
        row["current_stream_public"] = per_call_us(lambda: torch.cuda.current_stream(dev).cuda_stream)
        row["current_stream_raw"] = per_call_us(lambda: torch._C._cuda_getCurrentRawStream(dev))
        row["current_device"] = per_call_us(lambda: torch.cuda.current_device())
        backend = cache.backend

        def lease():
            with backend.handles.lease(dev):
                pass

        row["handle_lease"] = per_call_us(lease)
        row["set_stream_same"] = per_call_us(lambda: cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream))
        res[name] = row
    return res


def gil_child(directory: str) -> None:
    """In a fresh process: load stored plans on a thread, measure the main thread's longest stall."""
    import torch

    import plancache

    torch.cuda.init()
    cache = plancache.PlanCache(directory)
    env = cache.environment
    from plancache.key import environment_id

    keys = cache.local.entries_of(environment_id(env))
    done = threading.Event()
    loaded = []

    def load():
        t = time.perf_counter()
        for k in keys:
            e = cache.local.get(k)
            cache.backend.load(e.blob, [], 0)
            loaded.append(time.perf_counter() - t)
        done.set()

    th = threading.Thread(target=load)
    longest, last = 0.0, time.perf_counter()
    th.start()
    while not done.is_set():
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        sum(range(200))
    print(json.dumps({"keys": len(keys), "load_s": loaded[-1] if loaded else None, "main_longest_stall_ms": longest * 1e3}))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--gil":
        gil_child(sys.argv[2])
        return
    directory = tempfile.mkdtemp()
    out = {"launch": launch_probe(directory)}
    # A few more plans of other families for the GIL probe.
    import plancache
    from plancache import templates

    cache = plancache.PlanCache(directory)
    cache.get(templates.build("sdpa", b=2, h=2, s=256, d=64, causal=False))
    cache.close()
    r = subprocess.run([sys.executable, __file__, "--gil", directory], capture_output=True, text=True)
    out["gil"] = r.stdout.strip()[-500:] or r.stderr[-1500:]
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as exc:
        out["triton"] = repr(exc)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
