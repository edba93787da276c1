"""GPU test of plancache.integrations.frontend: unchanged cuDNN Frontend code (``@cudnn.jit``,
``@cudnn.graph_cache``, ``with cudnn.graph(handle) as (g, _)``) for a conv, a matmul
epilogue, SDPA forward and backward and a layernorm, run in three fresh processes:

* ``frontend``: the frontend's own decorators (unpatched);
* ``cold``: the same code after ``plancache.install()``, on an empty cache (autotune, store);
* ``warm``: the same again in a new process on that cache (deserialize, nothing built).

Each process binds tensors by the uids the decorator returns and runs the returned graph
with ``g.execute(pack, workspace, handle=handle)``. Outputs must match the frontend's
(bf16 tolerance) and PyTorch's. The first-call latency of each graph (building the graph
and planning it) is printed per process. Marked ``gpu``; skipped without CUDA; run by
scripts/gpu-check. Well under 90 s on an H200 (three process starts, small shapes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

#: Relative error (norm) of bf16 outputs: against the frontend's and a float32 reference.
TOLERANCE = 2e-2
ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ the child process


def _row_major(dims: list[int]) -> list[int]:
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    return strides


def _out(t: Any, dims: list[int], strides: list[int], dtype: Any) -> None:
    t.set_output(True).set_data_type(dtype).set_dim(dims).set_stride(strides)


def make_builders(cudnn: Any, handle: Any) -> dict[str, Any]:
    """The graphs, written as frontend code is: decorated with ``cudnn.jit`` (and for the
    matmul also ``cudnn.graph_cache``), looked up on ``cudnn`` when this runs, so the
    patched decorators apply after ``plancache.install()``."""
    DT, A, FALLBACK = cudnn.data_type, cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK
    bf16 = {"io_data_type": DT.BFLOAT16, "intermediate_data_type": DT.FLOAT, "compute_data_type": DT.FLOAT}

    @cudnn.jit(heur_modes=[A, FALLBACK])
    def conv(n: int, c: int, hw: int, k: int) -> Any:
        with cudnn.graph(handle, **bf16) as (g, _):
            X = g.tensor(name="X", dim=[n, c, hw, hw], stride=[c * hw * hw, 1, c * hw, c], data_type=DT.BFLOAT16)
            W = g.tensor(name="W", dim=[k, c, 3, 3], stride=[c * 9, 1, c * 3, c], data_type=DT.BFLOAT16)
            Y = g.conv_fprop(X, W, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
            _out(Y, [n, k, hw, hw], [k * hw * hw, 1, k * hw, k], DT.BFLOAT16)
            return g, [X, W, Y]

    @cudnn.jit(heur_modes=[A, FALLBACK])
    @cudnn.graph_cache(key_fn=lambda b, m, n, k: ("matmul", b, m, n, k))
    def matmul(b: int, m: int, n: int, k: int) -> Any:
        with cudnn.graph(handle, **bf16) as (g, _):
            Am = g.tensor(name="A", dim=[b, m, k], stride=_row_major([b, m, k]), data_type=DT.BFLOAT16)
            Bm = g.tensor(name="B", dim=[b, k, n], stride=_row_major([b, k, n]), data_type=DT.BFLOAT16)
            bias = g.tensor(name="bias", dim=[1, 1, n], stride=[n, n, 1], data_type=DT.BFLOAT16)
            C = g.relu(g.bias(g.matmul(Am, Bm), bias))
            _out(C, [b, m, n], _row_major([b, m, n]), DT.BFLOAT16)
            return g, [Am, Bm, bias, C]

    @cudnn.jit(heur_modes=A)
    def sdpa_fwd(b: int, h: int, s: int, d: int, scale: float) -> Any:
        dims, stats_dims = [b, h, s, d], [b, h, s, 1]
        with cudnn.graph(handle, **bf16) as (g, _):
            q, k, v = (g.tensor(name=n, dim=dims, stride=_row_major(dims), data_type=DT.BFLOAT16) for n in "qkv")
            o, stats = g.sdpa(q, k, v, attn_scale=scale, use_causal_mask=True, generate_stats=True)
            _out(o, dims, _row_major(dims), DT.BFLOAT16)
            _out(stats, stats_dims, _row_major(stats_dims), DT.FLOAT)
            return g, [q, k, v, o, stats]

    @cudnn.jit(heur_modes=A)
    def sdpa_bwd(b: int, h: int, s: int, d: int, scale: float) -> Any:
        dims, stats_dims = [b, h, s, d], [b, h, s, 1]
        with cudnn.graph(handle, **bf16) as (g, _):
            q, k, v, o, dO = (
                g.tensor(name=n, dim=dims, stride=_row_major(dims), data_type=DT.BFLOAT16) for n in ("q", "k", "v", "o", "dO")
            )
            stats = g.tensor(name="stats", dim=stats_dims, stride=_row_major(stats_dims), data_type=DT.FLOAT)
            dq, dk, dv = g.sdpa_backward(q, k, v, o, dO, stats, attn_scale=scale, use_causal_mask=True)
            for t in (dq, dk, dv):
                _out(t, dims, _row_major(dims), DT.BFLOAT16)
            return g, [q, k, v, o, dO, stats, dq, dk, dv]

    @cudnn.jit(heur_modes=[A, FALLBACK])
    def layernorm(rows: int, hidden: int) -> Any:
        x_dims, p_dims, s_dims = [rows, hidden, 1, 1], [1, hidden, 1, 1], [rows, 1, 1, 1]
        with cudnn.graph(handle, **bf16) as (g, _):
            X = g.tensor(name="X", dim=x_dims, stride=[hidden, 1, hidden, hidden], data_type=DT.BFLOAT16)
            scale = g.tensor(name="scale", dim=p_dims, stride=[hidden, 1, hidden, hidden], data_type=DT.FLOAT)
            bias = g.tensor(name="bias", dim=p_dims, stride=[hidden, 1, hidden, hidden], data_type=DT.FLOAT)
            eps = g.tensor(name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.FLOAT, is_pass_by_value=True)
            Y, mean, inv_var = g.layernorm(
                norm_forward_phase=cudnn.norm_forward_phase.TRAINING, input=X, scale=scale, bias=bias, epsilon=eps
            )
            _out(Y, x_dims, [hidden, 1, hidden, hidden], DT.BFLOAT16)
            _out(mean, s_dims, [1, 1, 1, 1], DT.FLOAT)
            _out(inv_var, s_dims, [1, 1, 1, 1], DT.FLOAT)
            return g, [X, scale, bias, eps, Y, mean, inv_var]

    return {"conv": conv, "matmul": matmul, "sdpa_fwd": sdpa_fwd, "sdpa_bwd": sdpa_bwd, "layernorm": layernorm}


def child(mode: str, out_path: str) -> None:
    """Run every graph once, the first call timed; save outputs, errors and latencies."""
    import cudnn
    import torch

    if mode != "frontend":
        import plancache

        plancache.install()
    torch.manual_seed(0)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    builders = make_builders(cudnn, handle)
    dev = "cuda"

    def randn(*dims: int, scale: float = 0.5) -> Any:
        return (torch.randn(*dims, device=dev) * scale).to(torch.bfloat16)

    latency: dict[str, float] = {}
    outputs: dict[str, list[Any]] = {}
    errors: dict[str, float] = {}

    def call(name: str, *args: Any) -> tuple[Any, list[int]]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph, uids = builders[name](*args)
        latency[name] = time.perf_counter() - start
        return graph, uids

    def execute(graph: Any, uids: list[int], tensors: list[Any]) -> None:
        workspace = torch.empty(max(graph.get_workspace_size(), 1), device=dev, dtype=torch.uint8)
        graph.execute(dict(zip(uids, tensors)), workspace, handle=handle)
        torch.cuda.synchronize()

    def error(got: Any, want: Any) -> float:
        got, want = got.float(), want.float()
        return float((got - want).norm() / want.norm().clamp_min(1e-12))

    # conv
    n, c, hw, k = 8, 64, 32, 64
    x = randn(n, c, hw, hw).to(memory_format=torch.channels_last)
    w = randn(k, c, 3, 3, scale=0.1).to(memory_format=torch.channels_last)
    y = torch.empty(n, k, hw, hw, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    execute(*call("conv", n, c, hw, k), [x, w, y])
    outputs["conv"] = [y]
    errors["conv"] = error(y, torch.nn.functional.conv2d(x.float(), w.float(), padding=1))

    # matmul epilogue
    b, m, nn, kk = 4, 256, 256, 128
    a, bm, bias = randn(b, m, kk), randn(b, kk, nn), randn(1, 1, nn)
    cm = torch.empty(b, m, nn, device=dev, dtype=torch.bfloat16)
    execute(*call("matmul", b, m, nn, kk), [a, bm, bias, cm])
    outputs["matmul"] = [cm]
    errors["matmul"] = error(cm, torch.relu(a.float() @ bm.float() + bias.float()))

    # SDPA forward, then backward on its output and stats
    bb, h, s, d = 2, 4, 256, 64
    scale = d**-0.5
    q, kt, v = randn(bb, h, s, d, scale=1.0), randn(bb, h, s, d, scale=1.0), randn(bb, h, s, d, scale=1.0)
    o = torch.empty(bb, h, s, d, device=dev, dtype=torch.bfloat16)
    stats = torch.empty(bb, h, s, 1, device=dev, dtype=torch.float32)
    execute(*call("sdpa_fwd", bb, h, s, d, scale), [q, kt, v, o, stats])
    qf, kf, vf = (t.float().requires_grad_(True) for t in (q, kt, v))
    of = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    outputs["sdpa_fwd"] = [o, stats]
    errors["sdpa_fwd"] = error(o, of)
    dO = randn(bb, h, s, d, scale=1.0)
    dq, dk, dv = (torch.empty(bb, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    execute(*call("sdpa_bwd", bb, h, s, d, scale), [q, kt, v, o, dO, stats, dq, dk, dv])
    of.backward(dO.float())
    outputs["sdpa_bwd"] = [dq, dk, dv]
    errors["sdpa_bwd"] = max(error(dq, qf.grad), error(dk, kf.grad), error(dv, vf.grad))

    # layernorm
    rows, hidden = 1024, 768
    xl = randn(rows, hidden, 1, 1, scale=1.0)
    gamma = torch.randn(1, hidden, 1, 1, device=dev) * 0.5 + 1.0
    beta = torch.randn(1, hidden, 1, 1, device=dev) * 0.1
    eps = torch.full((1, 1, 1, 1), 1e-5, dtype=torch.float32)  # pass by value: on the host
    yl = torch.empty_like(xl)
    mean = torch.empty(rows, 1, 1, 1, device=dev, dtype=torch.float32)
    inv_var = torch.empty(rows, 1, 1, 1, device=dev, dtype=torch.float32)
    execute(*call("layernorm", rows, hidden), [xl, gamma, beta, eps, yl, mean, inv_var])
    want = torch.nn.functional.layer_norm(xl.float().view(rows, hidden), (hidden,), gamma.view(hidden), beta.view(hidden), 1e-5)
    outputs["layernorm"] = [yl, mean]
    errors["layernorm"] = error(yl.view(rows, hidden), want)

    counters = None
    if mode != "frontend":
        import plancache.integrations.frontend

        counters = dict(plancache.integrations.frontend.current().counters)
    torch.save({k: [t.cpu() for t in v] for k, v in outputs.items()}, out_path)
    print(json.dumps({"mode": mode, "latency": latency, "errors": errors, "counters": counters}))


# ------------------------------------------------------------------ the test

if __name__ != "__main__":
    torch = pytest.importorskip("torch")
    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
    ]


def _run(mode: str, cache_dir: Path, out: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "PLANCACHE_DIR": str(cache_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("PLANCACHE_PATCH_CUDNN", None)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, __file__, mode, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{mode}: {result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["process_s"] = time.perf_counter() - started
    return report


def test_frontend_code_gets_persistent_plans(tmp_path: Path) -> None:
    cache_dir = tmp_path / "plancache"
    reports = {mode: _run(mode, cache_dir, tmp_path / f"{mode}.pt") for mode in ("frontend", "cold", "warm")}
    outputs = {mode: torch.load(tmp_path / f"{mode}.pt") for mode in reports}
    graphs = list(reports["frontend"]["latency"])

    print(f"\nfirst call in a fresh process (graph construction + planning), ms; cache {cache_dir}")
    print(f"{'graph':<10} {'frontend':>10} {'cold':>10} {'warm':>10}")
    for name in graphs:
        print(f"{name:<10} " + " ".join(f"{1e3 * reports[m]['latency'][name]:>10.1f}" for m in reports))
    print(f"{'total':<10} " + " ".join(f"{1e3 * sum(reports[m]['latency'].values()):>10.1f}" for m in reports))
    print("process wall, s: " + ", ".join(f"{m} {reports[m]['process_s']:.1f}" for m in reports))
    print("error vs torch: " + json.dumps({m: {g: round(e, 5) for g, e in r["errors"].items()} for m, r in reports.items()}))

    for mode, report in reports.items():
        for name, err in report["errors"].items():
            assert err <= TOLERANCE, (mode, name, err)
    for mode in ("cold", "warm"):
        for name in graphs:
            for got, want in zip(outputs[mode][name], outputs["frontend"][name]):
                rel = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
                assert rel <= TOLERANCE, (mode, name, rel)
    cold, warm = reports["cold"]["counters"], reports["warm"]["counters"]
    assert cold["builds"] == len(graphs) and cold["misses"] == len(graphs), cold
    assert warm["builds"] == 0 and warm["misses"] == 0 and warm["hits"] == len(graphs), warm


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
