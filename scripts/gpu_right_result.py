"""A right result every time, on a GPU: what plancache stores is checked, and autotuning
never faults. Run by scripts/gpu-check (part "right"); needs an NVIDIA GPU with cuDNN.

    python3 scripts/gpu_right_result.py [--out results.json]

1. **Epilogue graphs.** Twelve matmuls whose epilogue some cuDNN 9.19 engines compute
   wrongly (``relu(negative_slope=0.2)``, ``relu(lower_clip=0, upper_clip=1)``,
   ``leaky_relu(0.1)``; fp16 and bf16; [1,64,32]x[1,32,64] and [4,512,1024]x[4,1024,512]).
   For each policy: a fresh process on an empty cache looks them up (autotune, check,
   store) and compares each output with a float32 PyTorch reference; a second fresh
   process on that cache does the same from the store. The frontend alone (its
   heuristic choice of modes A, B and FALLBACK) is the baseline.
2. **A ragged, bucketed SDPA program** written in the frontend's idioms
   (``@cudnn.jit`` over ``@cudnn.graph_cache``, ``with cudnn.graph(handle)``), one graph per
   batch-size bucket, run unchanged by the frontend, then under ``plancache.install()`` cold
   and warm: outputs against the frontend's and PyTorch's, CUDA errors, hits.
3. **Paged-KV SDPA decode and an MoE grouped matmul** through ``PlanCache.get`` (every
   policy's checks, exhaustive), cold and in a fresh process.

Every process is fresh; a CUDA error anywhere is reported, not hidden.

``--smoke``: the epilogue graphs at one tiny shape, paged decode and MoE, through
``PlanCache.get`` on the CPU test backend under every policy, cold and from the store, each
child in this process under its environment (its report still through its file); the
frontend's own baseline, the drop-in (``plancache.install()``, which patches the frontend
for the whole process) and the ragged program in the frontend's idioms are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
from gpu_sweep_epilogues import EPILOGUES as SWEPT  # noqa: E402
from gpu_sweep_epilogues import reference_epilogue  # noqa: E402

#: Every epilogue where scripts/gpu_sweep_epilogues.py found an engine that computes it
#: wrongly after a matmul (H200, cuDNN 9.19: eng0 and its knob variant, for each of them).
EPILOGUES = ("relu_slope", "relu_lower", "relu_upper", "relu_clip_0_1", "relu_clip_-1_1", "relu_slope_lower", "relu_slope_upper",
             "relu_slope_lower_upper", "leaky_relu")  # fmt: skip
SHAPES = ((1, 64, 32, 64), (4, 512, 1024, 512))  # b, m, k, n
DTYPES = ("half", "bfloat16")
ULP = {"half": 2.0**-10, "bfloat16": 2.0**-7}
#: Largest max|out - ref| / max|ref| allowed (the earlier measure, printed for comparison).
RIGHT = {"half": 0.01, "bfloat16": 0.03}
PAGED = {"b": 4, "h": 8, "d": 128, "block": 16, "pages": 8, "pool": 64}
MOE = {"experts": 8, "tokens": 512, "hidden": 256, "n": 128}
#: What a smoke run skips, by child: the frontend's own runs and the drop-in.
GPU_ONLY = {("epilogue", "frontend"): "epilogue frontend: the frontend's own builds",
            ("epilogue", "dropin"): "epilogue dropin: plancache.install() patches the frontend in this process",
            ("ragged", "frontend"): "ragged: the frontend's idioms (@cudnn.jit, @cudnn.graph_cache)",
            ("ragged", "cold"): "ragged: the frontend's idioms (@cudnn.jit, @cudnn.graph_cache)",
            ("ragged", "warm"): "ragged: the frontend's idioms (@cudnn.jit, @cudnn.graph_cache)"}  # fmt: skip


def _smoke_sizes() -> None:
    """A smoke run's graphs (module globals, read by every child in this process)."""
    global SHAPES, PAGED, MOE
    SHAPES = ((1, 8, 16, 8),)
    PAGED = {"b": 2, "h": 2, "d": 16, "block": 4, "pages": 2, "pool": 8}
    MOE = {"experts": 2, "tokens": 8, "hidden": 16, "n": 8}


def graphs() -> list[tuple[str, str, tuple[int, int, int, int]]]:
    return [(e, d, s) for e in EPILOGUES for d in DTYPES for s in SHAPES]


def epilogue_graph(cudnn: Any, epilogue: str, dtype: str, shape: tuple[int, int, int, int]) -> Any:
    DT = cudnn.data_type
    io = {"half": DT.HALF, "bfloat16": DT.BFLOAT16}[dtype]
    b, m, k, n = shape
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    a = g.tensor(name="A", dim=[b, m, k], stride=[m * k, k, 1], data_type=io)
    w = g.tensor(name="B", dim=[b, k, n], stride=[k * n, n, 1], data_type=io)
    c = g.matmul(a, w, compute_data_type=DT.FLOAT)
    method, attrs = next((m_, a_) for name, m_, a_ in SWEPT if name == epilogue)
    y = getattr(g, method)(c, **attrs)
    y.set_output(True).set_data_type(io).set_dim([b, m, n]).set_stride([m * n, n, 1])
    for uid, t in enumerate((a, w, y), start=1):
        t.set_uid(uid)
    return g


def epilogue_reference(torch: Any, epilogue: str, x: Any) -> Any:
    method, attrs = next((m_, a_) for name, m_, a_ in SWEPT if name == epilogue)
    return reference_epilogue(torch, method, attrs, x)


def relative_error(got: Any, want: Any) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def wrong_elements(got: Any, want: Any, dtype: str) -> int:
    """Elements further from the float32 reference than 2 ulp of their own size plus 1e-3 of
    the reference's root mean square: a result is right with none."""
    got, want = got.float(), want.float()
    rms = float(want.pow(2).mean().sqrt())
    return int(((got - want).abs() > 2 * ULP[dtype] * want.abs() + 1e-3 * rms).sum())


# ------------------------------------------------------------------ children (fresh processes)


def child_epilogues(policy: str, out: str) -> dict[str, Any]:
    """One process: every epilogue graph through PlanCache.get (or the frontend alone)."""
    import cudnn
    import torch

    rows = []
    cache = None
    if policy == "dropin":  # the frontend's own five steps, served by plancache (PLANCACHE_PATCH_CUDNN=1)
        import plancache

        plancache.install()
    elif policy != "frontend":
        import plancache

        cache = plancache.PlanCache(backend=benchlib.backend(), auto_prime=False)
        options = plancache.BuildOptions(policy=policy)
    handle = cudnn.create_handle() if cache is None else None  # the frontend's own runs
    device = benchlib.device()
    generator = torch.Generator(device=device).manual_seed(1)
    for epilogue, dtype, shape in graphs():
        b, m, k, n = shape
        tdtype = getattr(torch, dtype)
        a = torch.randn(b, m, k, device=device, generator=generator).to(tdtype)
        w = torch.randn(b, k, n, device=device, generator=generator).to(tdtype)
        y = torch.empty(b, m, n, device=device, dtype=tdtype)
        row: dict[str, Any] = {"graph": f"{epilogue} {dtype} {'x'.join(map(str, shape))}"}
        try:
            graph = epilogue_graph(cudnn, epilogue, dtype, shape)
            if cache is None:
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
                workspace = torch.empty(max(graph.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
                cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
                graph.execute({1: a, 2: w, 3: y}, workspace, handle=handle)
            else:
                plan = cache.get(graph, options=options)
                plan.execute({1: a, 2: w, 3: y})
                row["source"] = plan.source
                row["engine"] = plan.engine.name if plan.engine else None
                entry = cache.store.get(plan.key) if cache.store is not None else None
                row["check"] = entry.check if entry is not None else None
            benchlib.synchronize(torch)
            want = epilogue_reference(torch, epilogue, a.float() @ w.float())
            row["error"] = relative_error(y, want)
            row["wrong_elements"] = wrong_elements(y, want, dtype)
            row["right"] = row["wrong_elements"] == 0
        except Exception as exc:
            row["failure"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["right"] = False
        rows.append(row)
    counters = dict(cache.counters) if cache is not None else None
    if policy == "dropin":
        import plancache.integrations.frontend

        counters = dict(plancache.integrations.frontend.current().counters)
    report = {"policy": policy, "rows": rows, "counters": counters}
    Path(out).write_text(json.dumps(report, default=str))
    return report


def _ragged_program(cudnn: Any, torch: Any, handle: Any) -> Any:
    """A ragged SDPA forward, one graph per batch-size bucket, in the frontend's idioms."""
    DT = cudnn.data_type
    h, s, d = 4, 128, 64

    @cudnn.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    @cudnn.graph_cache(key_fn=lambda bucket: ("ragged_sdpa", bucket))
    def ragged_sdpa(bucket: int) -> Any:
        with cudnn.graph(handle, io_data_type=DT.BFLOAT16, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT) as (g, _):
            ro = {n: g.tensor(name=f"ro_{n}", dim=[bucket + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32) for n in "qkvo"}
            layout = {"dim": [bucket, h, s, d], "stride": [s * h * d, d, h * d, 1], "data_type": DT.BFLOAT16}
            q = g.tensor(name="q", ragged_offset=ro["q"], **layout)
            k = g.tensor(name="k", ragged_offset=ro["k"], **layout)
            v = g.tensor(name="v", ragged_offset=ro["v"], **layout)
            sq = g.tensor(name="seq_q", dim=[bucket, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
            skv = g.tensor(name="seq_kv", dim=[bucket, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
            o, _stats = g.sdpa(q=q, k=k, v=v, attn_scale=d**-0.5, generate_stats=False, use_causal_mask=True,
                               use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv)  # fmt: skip
            o.set_output(True).set_dim(layout["dim"]).set_stride(layout["stride"]).set_ragged_offset(ro["o"])
            return g, [ro["q"], ro["k"], ro["v"], ro["o"], q, k, v, sq, skv, o]

    def run(bucket: int, generator: Any) -> tuple[float, Any, float]:
        lengths = torch.randint(1, s + 1, (bucket,), generator=generator)
        offsets = torch.zeros(bucket + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(lengths, 0) * h * d
        total = bucket * s * h * d
        q, k, v = (torch.randn(total, generator=generator).to(torch.bfloat16).cuda() for _ in range(3))
        out = torch.zeros(total, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        started = time.perf_counter()
        graph, uids = ragged_sdpa(bucket)
        first_call = time.perf_counter() - started
        ro = offsets.view(-1, 1, 1, 1).cuda()
        seq = lengths.to(torch.int32).view(-1, 1, 1, 1).cuda()
        tensors = [ro, ro, ro, ro, q, k, v, seq, seq, out]
        workspace = torch.empty(max(graph.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
        graph.execute(dict(zip(uids, tensors)), workspace, handle=handle)
        torch.cuda.synchronize()
        worst = 0.0
        for i in range(bucket):
            start, n = int(offsets[i]), int(lengths[i])

            def view(t: Any, start: int = start, n: int = n) -> Any:
                return t[start : start + n * h * d].view(n, h, d).transpose(0, 1).float()

            want = torch.nn.functional.scaled_dot_product_attention(view(q), view(k), view(v), is_causal=True, scale=d**-0.5)
            worst = max(worst, relative_error(view(out), want))
        return first_call, out, worst

    return run


def child_ragged(mode: str, out: str) -> dict[str, Any]:
    import cudnn
    import torch

    if mode != "frontend":
        import plancache

        plancache.install()
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    run = _ragged_program(cudnn, torch, handle)
    generator = torch.Generator().manual_seed(3)
    report: dict[str, Any] = {"mode": mode, "buckets": {}}
    outputs = {}
    try:
        for bucket in (1, 2, 4):
            first_call, output, error = run(bucket, generator)
            report["buckets"][bucket] = {"first_call_ms": 1e3 * first_call, "error": error}
            outputs[bucket] = output.cpu()
    except Exception as exc:
        report["failure"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    if mode != "frontend":
        import plancache.integrations.frontend

        report["counters"] = dict(plancache.integrations.frontend.current().counters)
    torch.save(outputs, out + ".pt")
    Path(out).write_text(json.dumps(report, default=str))
    return report


def _paged(cudnn: Any, torch: Any) -> tuple[Any, dict[int, Any], Any]:
    DT = cudnn.data_type
    b, h, d, block, pages, pool = (PAGED[k] for k in ("b", "h", "d", "block", "pages", "pool"))
    g = cudnn.pygraph(io_data_type=DT.BFLOAT16, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    q = g.tensor(name="q", dim=[b, h, 1, d], stride=[h * d, d, h * d, 1], data_type=DT.BFLOAT16)
    layout = {"dim": [pool, h, block, d], "stride": [h * block * d, block * d, d, 1], "data_type": DT.BFLOAT16}
    k, v = g.tensor(name="k_cache", **layout), g.tensor(name="v_cache", **layout)
    tk, tv = (g.tensor(name=f"table_{n}", dim=[b, 1, pages, 1], stride=[pages, pages, 1, 1], data_type=DT.INT32) for n in "kv")
    sq = g.tensor(name="seq_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    skv = g.tensor(name="seq_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=d**-0.5, generate_stats=False, use_padding_mask=True, seq_len_q=sq,
                  seq_len_kv=skv, paged_attention_k_table=tk, paged_attention_v_table=tv,
                  paged_attention_max_seq_len_kv=pages * block)  # fmt: skip
    o.set_output(True).set_dim([b, h, 1, d]).set_stride([h * d, d, h * d, 1])
    for uid, t in enumerate((q, k, v, tk, tv, sq, skv, o), start=1):
        t.set_uid(uid)
    gen = torch.Generator().manual_seed(5)
    table = torch.randperm(pool, generator=gen)[: b * pages].to(torch.int32).view(b, 1, pages, 1)
    lengths = torch.randint(1, pages * block + 1, (b,), generator=gen).to(torch.int32)
    tensors = {
        1: torch.randn(b, h, 1, d, generator=gen).to(torch.bfloat16), 2: torch.randn(pool, h, block, d, generator=gen).to(torch.bfloat16),
        3: torch.randn(pool, h, block, d, generator=gen).to(torch.bfloat16), 4: table, 5: table.clone(),
        6: torch.ones(b, 1, 1, 1, dtype=torch.int32), 7: lengths.view(b, 1, 1, 1), 8: torch.zeros(b, h, 1, d, dtype=torch.bfloat16),
    }  # fmt: skip
    tensors = {u: t.to(benchlib.device()).as_strided(t.shape, t.stride()) for u, t in tensors.items()}

    def reference(t: dict[int, Any]) -> Any:
        outs = []
        for i in range(b):
            idx = t[4][i].view(-1).long()
            kk = t[2][idx].permute(1, 0, 2, 3).reshape(h, pages * block, d)[:, : int(lengths[i])].float()
            vv = t[3][idx].permute(1, 0, 2, 3).reshape(h, pages * block, d)[:, : int(lengths[i])].float()
            outs.append(torch.nn.functional.scaled_dot_product_attention(t[1][i].float(), kk, vv, scale=d**-0.5))
        return torch.stack(outs)

    return g, tensors, reference


def _moe(cudnn: Any, torch: Any) -> tuple[Any, dict[int, Any], Any]:
    DT = cudnn.data_type
    experts, tokens, hidden, n = (MOE[k] for k in ("experts", "tokens", "hidden", "n"))
    device = benchlib.device()
    g = cudnn.pygraph(intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    token = g.tensor(name="token", dim=[1, tokens, hidden], stride=[tokens * hidden, hidden, 1], data_type=DT.BFLOAT16)
    weight = g.tensor(name="weight", dim=[experts, hidden, n], stride=[hidden * n, 1, hidden], data_type=DT.BFLOAT16)
    offsets = g.tensor(name="first_token_offset", dim=[experts, 1, 1], stride=[1, 1, 1], data_type=DT.INT32)
    out = g.moe_grouped_matmul(token, weight, offsets, mode=cudnn.moe_grouped_matmul_mode.NONE, compute_data_type=DT.FLOAT)
    out.set_data_type(DT.BFLOAT16).set_output(True)
    for uid, t in enumerate((token, weight, offsets, out), start=1):
        t.set_uid(uid)
    gen = torch.Generator().manual_seed(7)
    cuts = torch.sort(torch.randint(0, tokens, (experts - 1,), generator=gen)).values
    first = torch.cat([torch.zeros(1, dtype=torch.int64), cuts]).to(torch.int32)
    w = torch.randn(experts, n, hidden, generator=gen).to(torch.bfloat16).transpose(1, 2)  # [E, H, N], column-major in HxN
    tensors = {1: torch.randn(1, tokens, hidden, generator=gen).to(torch.bfloat16).to(device), 2: w.to(device),
               3: first.view(experts, 1, 1).to(device), 4: torch.zeros(1, tokens, n, dtype=torch.bfloat16, device=device)}  # fmt: skip

    def reference(t: dict[int, Any]) -> Any:
        bounds = [int(x) for x in first.tolist()] + [tokens]
        ref = torch.zeros(tokens, n, device=device)
        for e in range(experts):
            ref[bounds[e] : bounds[e + 1]] = t[1][0, bounds[e] : bounds[e + 1]].float() @ t[2][e].float()
        return ref.unsqueeze(0)

    return g, tensors, reference


def child_special(mode: str, out: str) -> dict[str, Any]:
    """Paged decode and MoE through PlanCache.get, exhaustive (cold, or from the store)."""
    import cudnn
    import torch

    import plancache

    cache = plancache.PlanCache(backend=benchlib.backend(), auto_prime=False)
    rows = []
    for name, make in (("paged_decode", _paged), ("moe_grouped_matmul", _moe)):
        row: dict[str, Any] = {"graph": name}
        try:
            graph, tensors, reference = make(cudnn, torch)
            plan = cache.get(graph, options=plancache.BuildOptions(policy="exhaustive"))
            plan.execute(tensors)
            benchlib.synchronize(torch)
            row["error"] = relative_error(tensors[max(tensors)], reference(tensors))
            row["right"] = row["error"] <= RIGHT["bfloat16"]
            row["source"] = plan.source
            entry = cache.store.get(plan.key) if cache.store is not None else None
            row["check"] = entry.check if entry is not None else None
        except Exception as exc:
            row["failure"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            row["trace"] = traceback.format_exc()[-1500:]
        rows.append(row)
    try:
        benchlib.synchronize(torch)
        row_ok = True
    except Exception:
        row_ok = False
    report = {"mode": mode, "rows": rows, "context_alive": row_ok, "counters": dict(cache.counters)}
    Path(out).write_text(json.dumps(report, default=str))
    return report


# ------------------------------------------------------------------ the parent


CHILDREN = {"epilogue": child_epilogues, "ragged": child_ragged, "special": child_special}


class _RanHere:
    """A smoke run's child, already run in this process: what ``wait_all`` reads of a ``Popen``."""

    def __init__(self, returncode: int, log: str) -> None:
        self.returncode, self.log = returncode, log

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        return self.log, None


def _run_here(kind: str, mode: str, out: Path, env: dict[str, str]) -> _RanHere:
    """A smoke run's child: run in this process under the child's environment (restored
    afterwards), its report in its file; a part only a GPU runs is written as skipped."""
    if (kind, mode) in GPU_ONLY:
        benchlib.gpu_only(GPU_ONLY[kind, mode], lambda: None)
        out.write_text(json.dumps({"mode": mode, "skipped": benchlib.SKIPPED}))
        return _RanHere(0, "")
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        CHILDREN[kind](mode, str(out))
        return _RanHere(0, "")
    except Exception:
        return _RanHere(1, traceback.format_exc())
    finally:
        os.environ.clear()
        os.environ.update(saved)


def spawn(kind: str, mode: str, out: Path, cache_dir: Path) -> subprocess.Popen[str] | _RanHere:
    env = {**os.environ, "PLANCACHE_DIR": str(cache_dir), "PLANCACHE_AUTO_PRIME": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    env.pop("PLANCACHE_PATCH_CUDNN", None)
    if benchlib.smoke():
        return _run_here(kind, mode, out, env)
    return subprocess.Popen([sys.executable, __file__, "--child", kind, mode, str(out)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def wait_all(jobs: list[tuple[str, subprocess.Popen[str] | _RanHere, Path]]) -> dict[str, Any]:
    reports = {}
    for name, job, out in jobs:
        log, _ = job.communicate(timeout=900)
        try:
            reports[name] = json.loads(out.read_text())
        except (OSError, ValueError):
            reports[name] = {"failure": f"exit {job.returncode}: {log[-2000:]}"}
        reports[name]["exit"] = job.returncode
        if job.returncode != 0:
            print(f"--- {name} exited {job.returncode}:\n{log[-3000:]}")
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write every result as JSON here")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    if benchlib.start_smoke(args.smoke):
        _smoke_sizes()
    if args.child:
        kind, mode, out = args.child
        CHILDREN[kind](mode, out)
        return 0
    work = benchlib.scratch("plancache-right-")
    policies = ("heuristic", "topk", "exhaustive", "dropin")
    # Round 1: every cold process at once (each policy its own cache), and the baselines.
    jobs = [("epilogue frontend", spawn("epilogue", "frontend", work / "ef.json", work / "none"), work / "ef.json")]
    jobs += [
        (f"epilogue {p} cold", spawn("epilogue", p, work / f"e-{p}-cold.json", work / p), work / f"e-{p}-cold.json")
        for p in policies
    ]
    jobs += [("ragged frontend", spawn("ragged", "frontend", work / "rf.json", work / "ragged"), work / "rf.json")]
    jobs += [("special cold", spawn("special", "cold", work / "s-cold.json", work / "special"), work / "s-cold.json")]
    reports = wait_all(jobs)
    jobs = [
        (f"epilogue {p} warm", spawn("epilogue", p, work / f"e-{p}-warm.json", work / p), work / f"e-{p}-warm.json")
        for p in policies
    ]
    jobs += [("ragged cold", spawn("ragged", "cold", work / "rc.json", work / "ragged"), work / "rc.json")]
    jobs += [("special warm", spawn("special", "warm", work / "s-warm.json", work / "special"), work / "s-warm.json")]
    reports.update(wait_all(jobs))
    reports.update(wait_all([("ragged warm", spawn("ragged", "warm", work / "rw.json", work / "ragged"), work / "rw.json")]))
    ok = report(reports, work)
    benchlib.report_skipped("gpu_right_result")
    if args.out:
        Path(args.out).write_text(json.dumps(reports, indent=1, default=str))
    return 0 if ok else 1


def report(reports: dict[str, Any], work: Path) -> bool:
    import torch

    ok = True
    total = len(graphs())
    print(
        f"\n1. epilogue graphs: right (every element within 2 ulp + 1e-3 rms of a float32 reference) of {total}, fresh processes"
    )
    print(f"{'policy':<12} {'cold':>6} {'hit':>6} {'hits':>5}  rejected engines (cold)")
    base = reports["epilogue frontend"]
    right_base = base["skipped"] if base.get("skipped") else sum(bool(r.get("right")) for r in base.get("rows", []))
    print(f"{'frontend':<12} {right_base:>6} {'-':>6} {'-':>5}  (its heuristic choice)")
    for policy in ("heuristic", "topk", "exhaustive", "dropin"):
        cold, warm = reports[f"epilogue {policy} cold"], reports[f"epilogue {policy} warm"]
        if cold.get("skipped") and warm.get("skipped"):  # a smoke run's GPU-only part
            print(f"{policy:<12} {cold['skipped']}")
            continue
        right_cold = sum(bool(r.get("right")) for r in cold.get("rows", []))
        right_warm = sum(bool(r.get("right")) for r in warm.get("rows", []))
        if policy == "dropin":  # the frontend's graph objects carry the plans: hits are counted by the drop-in
            hits = (warm.get("counters") or {}).get("hits", 0)
        else:
            hits = sum(r.get("source") == "loaded" for r in warm.get("rows", []))
        rejected = sorted({x["engine"] for r in cold.get("rows", []) for x in ((r.get("check") or {}).get("rejected") or [])})
        print(f"{policy:<12} {right_cold:>6} {right_warm:>6} {hits:>5}  {', '.join(rejected) or '-'}")
        ok &= right_cold == total and right_warm == total and hits == total
        for r in cold.get("rows", []) + warm.get("rows", []):
            if not r.get("right"):
                print(f"   wrong or failed: {policy} {r['graph']}: {r.get('error', r.get('failure'))} check={r.get('check')}")
    print("\n2. ragged SDPA, buckets 1, 2, 4, frontend idioms (@cudnn.jit over @cudnn.graph_cache)")
    outs = {}
    for mode in ("frontend", "cold", "warm"):
        r = reports[f"ragged {mode}"]
        if r.get("skipped"):  # a smoke run's GPU-only part
            print(f"{mode:<9} {r['skipped']}")
            continue
        path = work / {"frontend": "rf.json.pt", "cold": "rc.json.pt", "warm": "rw.json.pt"}[mode]
        outs[mode] = torch.load(path) if path.exists() else {}
        buckets = r.get("buckets", {})
        firsts = ", ".join(f"{b}: {v['first_call_ms']:.0f} ms" for b, v in buckets.items())
        errors = max((v["error"] for v in buckets.values()), default=float("nan"))
        print(f"{mode:<9} exit {r.get('exit')}  error vs torch {errors:.4f}  first calls {firsts}  {r.get('failure', '')}")
        if mode != "frontend":
            print(f"          counters {r.get('counters')}")
        ok &= r.get("exit") == 0 and "failure" not in r and len(buckets) == 3 and errors <= RIGHT["bfloat16"]
    for mode in ("cold", "warm"):
        for bucket, out in outs.get(mode, {}).items():
            want = outs["frontend"].get(bucket)
            diff = relative_error(out, want) if want is not None else float("nan")
            print(f"          {mode} bucket {bucket}: vs frontend {diff:.4f}")
            ok &= diff <= RIGHT["bfloat16"]
    if not reports["ragged warm"].get("skipped"):
        warm = reports["ragged warm"].get("counters") or {}
        ok &= warm.get("builds") == 0 and warm.get("hits") == 3
    print("\n3. paged-KV SDPA decode and MoE grouped matmul, exhaustive")
    for mode in ("cold", "warm"):
        r = reports[f"special {mode}"]
        for row in r.get("rows", []):
            check = row.get("check") or {}
            print(
                f"{mode:<5} {row['graph']:<20} source {row.get('source', '-'):<8} error {row.get('error', float('nan')):.4f} "
                f"check {check.get('status', '-')} ({check.get('agreeing', '-')}/{check.get('compared', '-')}, rejected "
                f"{[x['engine'] for x in check.get('rejected') or []]}) {row.get('failure', '')}"
            )
            supported = (
                "failure" not in row or "NotSupported" in row.get("failure", "") or "not supported" in row.get("failure", "")
            )
            ok &= supported and ("failure" in row or row.get("right", False))
        print(f"      CUDA context alive at the end: {r.get('context_alive')}")
        ok &= bool(r.get("context_alive"))
    print(f"\ngpu_right_result: {'PASSED' if ok else 'FAILED'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
