"""Every pointwise epilogue after a matmul and a convolution, every candidate engine, against
a float32 PyTorch reference and against plancache's element-wise check. Needs a GPU.

    python3 scripts/gpu_sweep_epilogues.py [--workers 8] [--out sweep.json]

For each graph (matmul or convolution; float16 or bfloat16; a small and a large shape; one
epilogue of ``EPILOGUES``: relu with every slope and clip alone and combined, leaky relu,
swish with and without beta, gelu, tanh, sigmoid, elu, softplus) every candidate of the
heuristic modes A, B and FALLBACK is built and launched once on plancache's synthetic
inputs. Each candidate is judged twice:

* **the oracle**: a float32 PyTorch reference. An element is wrong when it is further from
  the reference than two ulps of the output's type at its size plus 1e-3 of the
  reference's root mean square; a candidate with one wrong element is wrong.
* **plancache's check** (``autotuning.bounds``, ``autotuning.consensus``): the candidates are
  grouped as autotuning groups them, and those outside the majority are rejected.

Printed: every graph where some engine is wrong (to add to ``gpu_right_result.py``), the
false rejections (right by the oracle, rejected by the check: must be 0) and the misses
(wrong by the oracle, inside the majority: must be 0), and the widest margin a right
candidate used (its worst element's difference over its bound).

``--smoke``: a few epilogues after the small matmul and convolution in bfloat16, judged by
the same code (plancache's synthetic inputs, the oracle, ``autotuning.bounds`` and
``autotuning.consensus``, the summary and JSON), on the CPU test backend, one worker in this
process. The candidates are the CPU test backend's (its public candidate set, built and
launched on the sweep's inputs; one of them computes wrongly, as some cuDNN engines do);
the frontend's own candidates of modes A, B and FALLBACK are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import benchlib  # noqa: E402 - after the path it is found on

#: (name, method, attributes): every pointwise epilogue and attribute the frontend offers.
EPILOGUES: list[tuple[str, str, dict[str, float]]] = [
    ("relu", "relu", {}),
    ("relu_slope", "relu", {"negative_slope": 0.2}),
    ("relu_steep_slope", "relu", {"negative_slope": 3.0}),
    ("relu_lower", "relu", {"lower_clip": -1.0}),
    ("relu_upper", "relu", {"upper_clip": 1.0}),
    ("relu_clip_0_1", "relu", {"lower_clip": 0.0, "upper_clip": 1.0}),
    ("relu_clip_-1_1", "relu", {"lower_clip": -1.0, "upper_clip": 1.0}),
    ("relu_slope_lower", "relu", {"negative_slope": 0.1, "lower_clip": -1.0}),
    ("relu_slope_upper", "relu", {"negative_slope": 0.2, "upper_clip": 6.0}),
    ("relu_slope_lower_upper", "relu", {"negative_slope": 0.1, "lower_clip": -1.0, "upper_clip": 1.0}),
    ("leaky_relu", "leaky_relu", {"negative_slope": 0.1}),
    ("swish", "swish", {}),
    ("swish_beta", "swish", {"swish_beta": 1.5}),
    ("gelu", "gelu", {}),
    ("gelu_approx_tanh", "gelu_approx_tanh", {}),
    ("tanh", "tanh", {}),
    ("sigmoid", "sigmoid", {}),
    ("elu", "elu", {}),
    ("softplus", "softplus", {}),
]
OPS = ("matmul", "conv")
DTYPES = ("half", "bfloat16")
SIZES = ("small", "large")
ULP = {"half": 2.0**-10, "bfloat16": 2.0**-7}
#: A smoke run's graphs: a few epilogues after the small matmul and convolution, bfloat16.
SMOKE_EPILOGUES = ("relu", "relu_slope", "relu_clip_0_1", "gelu")
#: The CPU test backend's candidate that computes wrongly in a smoke run (as some engines do).
SMOKE_WRONG = 2


def graphs() -> list[tuple[str, str, str, str]]:
    if benchlib.smoke():
        return [(op, "bfloat16", "small", name) for op in OPS for name in SMOKE_EPILOGUES]
    return [(op, dtype, size, name) for op in OPS for dtype in DTYPES for size in SIZES for name, _, _ in EPILOGUES]


def reference_epilogue(torch: Any, method: str, attrs: dict[str, float], x: Any) -> Any:
    f = torch.nn.functional
    if method in ("relu", "leaky_relu"):
        # cuDNN's RELU_FWD, as the engines that agree compute it (H200, cuDNN 9.19): the
        # larger of the input capped at the upper clip and the slope's line through the
        # lower clip. With a slope below 1: the line below the lower clip, the input between
        # the clips, the upper clip above it until the line passes it; with a slope of 3,
        # three times a positive input.
        slope = attrs.get("negative_slope", 0.0)
        lower, upper = attrs.get("lower_clip", 0.0), attrs.get("upper_clip", math.inf)
        return torch.maximum(x.clamp(max=upper), lower + slope * (x - lower))
    if method == "swish":
        return x * torch.sigmoid(attrs.get("swish_beta", 1.0) * x)
    return {"gelu": f.gelu, "gelu_approx_tanh": lambda v: f.gelu(v, approximate="tanh"), "tanh": torch.tanh,
            "sigmoid": torch.sigmoid, "elu": f.elu, "softplus": f.softplus}[method](x)  # fmt: skip


def build(cudnn: Any, op: str, dtype: str, size: str, method: str, attrs: dict[str, float]) -> tuple[Any, dict[str, Any]]:
    DT = cudnn.data_type
    io = {"half": DT.HALF, "bfloat16": DT.BFLOAT16}[dtype]
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    if op == "matmul":
        b, m, k, n = (1, 64, 64, 64) if size == "small" else (4, 512, 1024, 512)
        a = g.tensor(name="A", dim=[b, m, k], stride=[m * k, k, 1], data_type=io)
        w = g.tensor(name="B", dim=[b, k, n], stride=[k * n, n, 1], data_type=io)
        x = g.matmul(a, w, compute_data_type=DT.FLOAT)
        out_dim, out_stride = [b, m, n], [m * n, n, 1]
        shape = {"op": op, "a": [b, m, k], "b": [b, k, n]}
    else:
        n, c, hw, k = (2, 16, 8, 16) if size == "small" else (8, 64, 56, 64)
        a = g.tensor(name="X", dim=[n, c, hw, hw], stride=[c * hw * hw, 1, hw * c, c], data_type=io)
        w = g.tensor(name="W", dim=[k, c, 3, 3], stride=[c * 9, 1, 3 * c, c], data_type=io)
        x = g.conv_fprop(a, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], compute_data_type=DT.FLOAT)
        out_dim, out_stride = [n, k, hw, hw], [k * hw * hw, 1, hw * k, k]
        shape = {"op": op, "x": [n, c, hw, hw], "w": [k, c, 3, 3]}
    y = getattr(g, method)(x, **attrs)
    y.set_output(True).set_data_type(io).set_dim(out_dim).set_stride(out_stride)
    for uid, t in enumerate((a, w, y), start=1):
        t.set_uid(uid)
    return g, shape


def before_epilogue(torch: Any, shape: dict[str, Any], pack: dict[int, Any]) -> Any:
    a, w = pack[1].float(), pack[2].float()
    return a @ w if shape["op"] == "matmul" else torch.nn.functional.conv2d(a, w, padding=1)


def reference(torch: Any, shape: dict[str, Any], pack: dict[int, Any], method: str, attrs: dict[str, float]) -> Any:
    return reference_epilogue(torch, method, attrs, before_epilogue(torch, shape, pack))


def sweep_one(op: str, dtype: str, size: str, name: str) -> dict[str, Any]:
    import cudnn
    import torch

    from plancache.autotuning.bounds import bounds
    from plancache.autotuning.consensus import Consensus, compare
    from plancache.autotuning.inputs import Refusal, materialize, plan_inputs
    from plancache.key import describe, tensor_table

    method, attrs = next((m, a) for n, m, a in EPILOGUES if n == name)
    row: dict[str, Any] = {"op": op, "dtype": dtype, "size": size, "epilogue": name}
    graph, shape = build(cudnn, op, dtype, size, method, attrs)
    description, specs = describe(graph), tensor_table(graph)
    device = benchlib.device()
    inputs = plan_inputs(description, specs, {})
    assert not isinstance(inputs, Refusal), inputs
    pack = materialize(inputs, torch, device, torch.Generator(device=device).manual_seed(0))
    want = reference(torch, shape, pack, method, attrs)
    rms = float(want.pow(2).mean().sqrt())
    ulp = ULP[dtype]
    found = bounds(description, specs, pack)
    row["coarse_bound"] = found[3].coarse
    consensus = Consensus(found)
    candidates: list[dict[str, Any]] = []
    kept: dict[int, Any] = {}  # every launched candidate's output, by slot
    results = benchlib.gpu_only("the frontend's candidates of modes A, B and FALLBACK, built and launched", _frontend_candidates,
                                 cudnn, torch, graph, pack)  # fmt: skip
    if results is None:  # a smoke run: the CPU test backend's candidates
        results = _backend_candidates(graph, description, pack)
    for cand, out in results:
        if out is None:  # not built, or its launch failed
            candidates.append(cand)
            continue
        got = out.float()
        bad = (got - want).abs() > 2 * ulp * want.abs() + 1e-3 * rms
        cand["oracle_wrong_elements"] = int(bad.sum())
        cand["oracle_worst_rel"] = float(((got - want).abs() / (want.abs() + 1e-3 * rms)).max())
        cand["right"] = cand["oracle_wrong_elements"] == 0
        if bool(bad.any()) and "samples" not in row:  # what the epilogue's input was where they differ
            x = before_epilogue(torch, shape, pack).reshape(-1)
            where = bad.reshape(-1).nonzero().reshape(-1)[:: max(1, int(bad.sum()) // 6)][:6]
            row["samples"] = {"engine": cand["engine"], "x": x[where].tolist(), "got": got.reshape(-1)[where].tolist(),
                              "want": want.reshape(-1)[where].tolist()}  # fmt: skip
        consensus.add(len(candidates), {3: out})
        kept[len(candidates)] = out
        cand["slot"] = len(candidates)
        candidates.append(cand)
    majority = consensus.majority()
    members = set(majority.members) if majority is not None else set()
    first = majority.outputs if majority is not None else None
    for cand in candidates:
        if "slot" not in cand:
            continue
        cand["agrees"] = cand["slot"] in members
        if first is not None:
            agreement = compare({3: kept[cand["slot"]]}, first, found)
            cand["worst_bound_ratio"] = agreement.worst if math.isfinite(agreement.worst) else None
            cand["outside"] = agreement.outside
    row["candidates"] = candidates
    row["majority"] = majority is not None
    launched = [c for c in candidates if "slot" in c]
    row["wrong_engines"] = [c["engine"] for c in launched if c["right"] is False]
    row["false_rejections"] = [c["engine"] for c in launched if c["right"] and not c["agrees"]] if majority else []
    row["misses"] = [c["engine"] for c in launched if c["right"] is False and c["agrees"]]
    row["right_margin"] = max((c.get("worst_bound_ratio") or 0.0 for c in launched if c["right"] and c["agrees"]), default=0.0)
    return row


def _frontend_candidates(cudnn: Any, torch: Any, graph: Any, pack: dict[int, Any]) -> list[tuple[dict[str, Any], Any]]:
    """Every distinct candidate of the frontend's modes A, B and FALLBACK, built and launched
    once on ``pack``: ``(row, a copy of its output)``, the output None when it was not built
    or its launch failed (the row says why)."""
    handle = cudnn.create_handle()
    stream = torch.cuda.current_stream()
    cudnn.set_stream(handle=handle, stream=stream.cuda_stream)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    seen, indices = set(), []
    for i in range(graph.get_execution_plan_count()):
        plan_name = graph.get_plan_name_at_index(i)
        if plan_name not in seen:
            seen.add(plan_name)
            indices.append((i, plan_name))
    launched: list[tuple[dict[str, Any], Any]] = []
    for index, plan_name in indices:
        cand: dict[str, Any] = {"index": index, "engine": plan_name}
        try:
            graph.build_plan_at_index(index)
        except Exception as exc:
            cand["not_built"] = str(exc)[:120]
            launched.append((cand, None))
            continue
        size_ws = graph.get_workspace_size_plan_at_index(index)
        workspace = torch.empty(max(size_ws, 1), dtype=torch.uint8, device="cuda")
        pack[3].zero_()
        try:
            graph.execute_plan_at_index(pack, workspace, index, handle)
            torch.cuda.synchronize()
        except Exception as exc:
            cand["failed"] = str(exc)[:120]
            launched.append((cand, None))
            continue
        launched.append((cand, pack[3].clone(memory_format=torch.contiguous_format)))
    return launched


def _backend_candidates(graph: Any, description: Any, pack: dict[int, Any]) -> list[tuple[dict[str, Any], Any]]:
    """A smoke run's candidates: the CPU test backend's candidate set for ``graph``, built
    and launched once on ``pack`` through the backend's public seam (candidate
    ``SMOKE_WRONG`` computes wrongly); as ``_frontend_candidates``."""
    import plancache
    from plancache.autotuning.candidates import Candidates
    from plancache.errors import BuildError
    from plancache.testing import CpuTestBackend

    backend = CpuTestBackend(wrong=[SMOKE_WRONG])
    found = Candidates.of(backend, graph, plancache.BuildOptions(), description, inputs=pack)
    launched: list[tuple[dict[str, Any], Any]] = []
    try:
        refused = found.prepare(plancache.MemoryBudget())
        assert refused is None, refused
        for index in range(len(found)):
            cand: dict[str, Any] = {"index": index, "engine": f"cpu-test-eng{found.engine(index).engine_id}"}
            try:
                found.build(index)
            except BuildError as exc:
                cand["not_built"] = str(exc)[:120]
                launched.append((cand, None))
                continue
            launched.append((cand, found.outputs(index)[3]))
    finally:
        found.close()
    return launched


def worker(items: list[list[str]], out: Path) -> None:
    rows = []
    for op, dtype, size, name in items:
        started = time.perf_counter()
        try:
            row = sweep_one(op, dtype, size, name)
        except Exception as exc:
            row = {"op": op, "dtype": dtype, "size": size, "epilogue": name, "failure": f"{type(exc).__name__}: {str(exc)[:300]}",
                   "trace": traceback.format_exc()[-1500:]}  # fmt: skip
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        out.write_text(json.dumps(rows, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("sweep.json"))
    parser.add_argument("--epilogues", default="", help="comma-separated epilogue names (default: all)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    smoke = benchlib.start_smoke(args.smoke)
    if args.worker is not None:
        worker(json.loads(args.worker), args.out)
        return 0
    items = [g for g in graphs() if not args.epilogues or g[3] in args.epilogues.split(",")]
    workers = 1 if smoke else args.workers
    shards = [items[i::workers] for i in range(workers)]
    parts = [args.out.with_suffix(f".part{i}.json") for i in range(len(shards))]
    if smoke:  # the one worker in this process, its rows still through its file
        worker([list(item) for item in shards[0]], parts[0])
    else:
        jobs = [
            subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(s), "--out", str(p)])
            for s, p in zip(shards, parts)
        ]
        for job in jobs:
            job.wait()
    rows = [r for p in parts if p.exists() for r in json.loads(p.read_text())]
    args.out.write_text(json.dumps(rows, indent=1, default=str))
    failures = [r for r in rows if "failure" in r]
    launched = sum(len([c for c in r.get("candidates", []) if "slot" in c]) for r in rows)
    right = sum(len([c for c in r.get("candidates", []) if c.get("right")]) for r in rows)
    judged = sum(len([c for c in r.get("candidates", []) if c.get("right") is not None]) for r in rows)
    false_rejections = [(r["op"], r["dtype"], r["size"], r["epilogue"], e) for r in rows for e in r.get("false_rejections", [])]
    misses = [(r["op"], r["dtype"], r["size"], r["epilogue"], e) for r in rows for e in r.get("misses", [])]
    print(f"graphs {len(rows)} (failed {len(failures)}), candidates launched {launched}, judged by the oracle {judged}, "
          f"right {right}")  # fmt: skip
    print("graphs with a wrong engine (oracle):")
    for r in rows:
        if r.get("wrong_engines"):
            print(f"  {r['op']:6} {r['dtype']:8} {r['size']:5} {r['epilogue']:24} wrong: {', '.join(r['wrong_engines'])}"
                  f"  majority={r['majority']} coarse={r['coarse_bound']}")  # fmt: skip
    print(f"false rejections (right, rejected): {len(false_rejections)} of {right}")
    for item in false_rejections:
        print("  ", *item)
    print(f"misses (wrong, in the majority): {len(misses)}")
    for item in misses:
        print("  ", *item)
    margins = [r.get("right_margin", 0.0) for r in rows if "failure" not in r]
    print(f"widest margin a right candidate used: {max(margins, default=0.0):.3g} bounds (a candidate is out past 4)")
    for r in failures:
        print(f"  failed: {r['op']} {r['dtype']} {r['size']} {r['epilogue']}: {r['failure']}")
    no_majority = [r for r in rows if "failure" not in r and not r.get("majority")]
    print(f"graphs without a majority: {len(no_majority)}")
    benchlib.report_skipped("gpu_sweep_epilogues")
    if smoke and failures:
        return 1
    return 1 if false_rejections or misses else 0


if __name__ == "__main__":
    sys.exit(main())
