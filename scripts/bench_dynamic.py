#!/usr/bin/env python3
"""Dynamic shapes: serving 20 batch sizes of a convolution and 20 sequence lengths of a
causal attention, each shape's first call timed in fresh processes.

Phases (each a fresh process):
  static       no plancache: a static heuristic build per shape (modes A+FALLBACK)
  dynamic      no plancache: dynamic-shape builds sharing one kernel cache
  cold         plancache (dynamic graphs, shared kernel cache), empty store: miss per shape
  warm         plancache, the store the cold phase filled: a hit per shape
  bucket_cold  plancache, padded to a few buckets, empty store
  bucket_warm  plancache, padded to the buckets, warm store
and the kernel-cache probe: the first dynamic build in a fresh process with and without
restoring a kernel cache serialized by another process. Every output is checked against
PyTorch. Needs an NVIDIA GPU; ``--out FILE`` writes every figure as JSON. ``--smoke``: a
few tiny shapes on the CPU test backend, every phase in this process, the phases without
plancache (the frontend's own builds) and the kernel-cache probe reported as skipped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import benchlib

CONV = {"c": 64, "h": 56, "w": 56, "k": 64}
CONV_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32]  # batch n
SDPA = {"b": 2, "h": 8, "d": 64, "causal": True}
SDPA_SIZES = [64 * i + 32 for i in range(1, 21)]  # sequence length s: 96 .. 1312
CONV_BUCKETS = [1, 2, 4, 8, 16, 32]
SDPA_BUCKETS = [256, 512, 768, 1024, 1280, 1536]
TOLERANCE = 1e-2


# The tensors that carry the varying dimension, and so are padded to a bucket: the image
# and output of the convolution (not its weights or bias); all four tensors of attention.
PADDED = {"conv": (1, 4), "sdpa": (1, 2, 3, 4)}


def _smoke_sizes() -> None:
    """A smoke run's shapes (module globals, read by every phase in this process)."""
    global CONV, CONV_SIZES, SDPA, SDPA_SIZES, CONV_BUCKETS, SDPA_BUCKETS
    CONV, CONV_SIZES, CONV_BUCKETS = {"c": 8, "h": 4, "w": 4, "k": 8}, [1, 3], [2, 4]
    SDPA, SDPA_SIZES, SDPA_BUCKETS = {"b": 1, "h": 1, "d": 16, "causal": True}, [16, 24], [16, 32]


def workloads() -> list[tuple[str, str, dict[str, Any], list[int], str, list[int], int]]:
    """(label, template, fixed params, sizes, varying param, buckets, padded dim)."""
    return [
        ("conv", "conv_bias_act", CONV, CONV_SIZES, "n", CONV_BUCKETS, 0),
        ("sdpa", "sdpa", SDPA, SDPA_SIZES, "s", SDPA_BUCKETS, 2),
    ]


def _setup() -> tuple[Any, Any]:
    """torch, and a cuDNN handle for the frontend's own builds (None in a smoke run)."""
    import torch

    return torch, benchlib.gpu_only("a cuDNN handle for the frontend's own builds", _frontend_handle, torch)


def _frontend_handle(torch: Any) -> Any:
    import cudnn

    torch.cuda.init()
    return cudnn.create_handle()


def _check(torch: Any, name: str, params: dict[str, Any], tensors: dict[int, Any], out: Any) -> float:
    from plancache.workflows import templates

    return benchlib.rel_error(out, templates.reference(name, tensors, **params))


def _raw_phase(dynamic: bool) -> dict[str, Any]:
    import cudnn

    from plancache.workflows import templates

    torch, handle = _setup()
    result: dict[str, Any] = {}
    for label, name, fixed, sizes, var, _buckets, _dim in workloads():
        kernel_cache = cudnn.create_kernel_cache() if dynamic else None
        times, errors = [], []
        for size in sizes:
            params = {**fixed, var: size, "dynamic": dynamic}
            tensors = templates.allocate(name, device="cuda", **params)
            torch.cuda.synchronize()
            started = time.perf_counter()
            graph = templates.build(name, kernel_cache=kernel_cache, handle=handle, **params)
            graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
            graph.execute(tensors, workspace, handle=handle)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            errors.append(_check(torch, name, params, tensors, tensors[4]))
        result[label] = {"seconds": times, "max_error": max(errors)}
    return result


def _skipped_raw_phase() -> dict[str, Any]:
    return {label: {"seconds": [None] * len(sizes), "max_error": None} for label, _n, _f, sizes, _v, _b, _d in workloads()}


def phase_static(_: dict[str, Any]) -> dict[str, Any]:
    return benchlib.gpu_only("static: the frontend's own builds", _raw_phase, dynamic=False) or _skipped_raw_phase()


def phase_dynamic(_: dict[str, Any]) -> dict[str, Any]:
    return benchlib.gpu_only("dynamic: the frontend's own builds", _raw_phase, dynamic=True) or _skipped_raw_phase()


def _cache_phase(args: dict[str, Any], bucketed: bool) -> dict[str, Any]:
    import plancache
    from plancache.workflows import buckets, templates

    torch, _ = _setup()
    cache = plancache.PlanCache(args["dir"], backend=benchlib.backend())
    cache.environment  # noqa: B018 - device properties: not part of a lookup
    cache.backend.prepare(cache.backend.current_device())  # nor is creating the cuDNN handle
    result: dict[str, Any] = {}
    for label, name, fixed, sizes, var, bucket_list, dim in workloads():
        times, errors, exec_ms = [], [], []
        for size in sizes:
            params = {**fixed, var: size, "dynamic": True}
            tensors = templates.allocate(name, device=benchlib.device(), **params)
            benchlib.synchronize(torch)
            started = time.perf_counter()
            if bucketed:
                padded_size = buckets.round_up(size, bucket_list)
                run_params = {**params, var: padded_size}
                run = {uid: (buckets.pad_to(t, dim, padded_size) if uid in PADDED[label] else t) for uid, t in tensors.items()}
            else:
                run_params, run = params, tensors
            plan = cache.get(templates.build(name, **run_params))
            plan.execute(run)
            out = run[4].narrow(dim, 0, size)
            benchlib.synchronize(torch)
            times.append(time.perf_counter() - started)
            errors.append(_check(torch, name, params, tensors, out))
            if size in (sizes[0], sizes[len(sizes) // 2], sizes[-1]):
                exec_ms.append(benchlib.gpu_ms(torch, lambda p=plan, r=run: p.execute(r), iters=10, repeats=5))
        result[label] = {"seconds": times, "max_error": max(errors), "exec_ms": exec_ms}
    result["counters"] = dict(cache.counters)
    cache.close()
    return result


def phase_cold(args: dict[str, Any]) -> dict[str, Any]:
    return _cache_phase(args, bucketed=False)


def phase_warm(args: dict[str, Any]) -> dict[str, Any]:
    return _cache_phase(args, bucketed=False)


def phase_bucket_cold(args: dict[str, Any]) -> dict[str, Any]:
    return _cache_phase(args, bucketed=True)


def phase_bucket_warm(args: dict[str, Any]) -> dict[str, Any]:
    return _cache_phase(args, bucketed=True)


def phase_kernel_cache(args: dict[str, Any]) -> dict[str, Any]:
    """First dynamic build in this process, of a shape not built before, after restoring
    the kernel cache file ``args['load']`` (if any); saves the kernel cache to ``args['save']``."""
    skipped = {label: None for label, *_ in workloads()}
    return benchlib.gpu_only("kernel cache: the frontend's own dynamic builds", _kernel_cache_probe, args) or skipped


def _kernel_cache_probe(args: dict[str, Any]) -> dict[str, Any]:
    import cudnn

    from plancache.workflows import templates

    torch, handle = _setup()
    result: dict[str, Any] = {}
    for label, name, fixed, sizes, var, _b, _d in workloads():
        kernel_cache = cudnn.create_kernel_cache()
        source = args.get("load")
        if source:
            kernel_cache.deserialize(Path(f"{source}.{label}").read_text())
        params = {**fixed, var: sizes[args["index"]], "dynamic": True}
        started = time.perf_counter()
        graph = templates.build(name, kernel_cache=kernel_cache, handle=handle, **params)
        graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        torch.cuda.synchronize()
        result[label] = time.perf_counter() - started
        if args.get("save"):
            Path(f"{args['save']}.{label}").write_text(kernel_cache.serialize())
    return result


PHASES = {name[len("phase_") :]: fn for name, fn in globals().items() if name.startswith("phase_")}


def main(argv: list[str] | None = None) -> None:
    opts = benchlib.parse_or_run_phase(__doc__.splitlines()[0], PHASES, argv, script=__file__)
    if opts is None:
        return
    if benchlib.smoke():
        _smoke_sizes()
    torch = benchlib.require_gpu("bench_dynamic")
    root = benchlib.scratch("plancache-dyn-", opts.keep)
    run = lambda phase, **a: benchlib.run_phase(__file__, phase, **a)  # noqa: E731
    r: dict[str, Any] = {
        "static": run("static"),
        "dynamic": run("dynamic"),
        "cold": run("cold", dir=str(root / "exact")),
        "warm": run("warm", dir=str(root / "exact")),
        "bucket_cold": run("bucket_cold", dir=str(root / "buckets")),
        "bucket_warm": run("bucket_warm", dir=str(root / "buckets")),
        "kc_save": run("kernel_cache", index=0, save=str(root / "kc")),
        "kc_none": run("kernel_cache", index=1),
        "kc_restored": run("kernel_cache", index=1, load=str(root / "kc")),
        "versions": benchlib.versions(torch),
    }
    print_table(r)
    benchlib.report_skipped("bench_dynamic")
    if opts.out:
        Path(opts.out).write_text(json.dumps(r, indent=2))


def _total(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def print_table(r: dict[str, Any]) -> None:
    fmt = benchlib.fmt
    phases = ("static", "dynamic", "cold", "warm", "bucket_cold", "bucket_warm")
    print(f"\nplancache dynamic-shape benchmark  {r['versions']}")
    for label, _name, _fixed, sizes, var, _b, _d in workloads():
        print(f"\n{label}: first-call latency per {var} (ms)")
        print(f"{var:>6} " + " ".join(f"{p:>11}" for p in phases))
        for i, size in enumerate(sizes):
            print(f"{size:>6} " + " ".join(fmt(r[p][label]["seconds"][i], "11.1f", 1e3) for p in phases))
        print(f"{'total':>6} " + " ".join(fmt(_total(r[p][label]["seconds"]), "11.0f", 1e3) for p in phases))
        print(f"{'maxerr':>6} " + " ".join(fmt(r[p][label]["max_error"], "11.1e") for p in phases))
        exact, padded = r["warm"][label]["exec_ms"], r["bucket_warm"][label]["exec_ms"]
        print(f"  execution ms (smallest/middle/largest {var}): exact " + " ".join(f"{x:.4f}" for x in exact)
              + "  bucketed " + " ".join(f"{x:.4f}" for x in padded))  # fmt: skip
        print(f"  kernel cache: first dynamic build in a fresh process {fmt(r['kc_none'][label], '.1f', 1e3)} ms,"
              f" after restoring a serialized kernel cache {fmt(r['kc_restored'][label], '.1f', 1e3)} ms")  # fmt: skip
    print(f"\ncounters: cold {r['cold']['counters']}\n          warm {r['warm']['counters']}")


if __name__ == "__main__":
    main()
