#!/usr/bin/env python3
"""A small model built from cuDNN graphs through plancache, and its start-up demo.

The model: a ResNet-style stem of three fused convolutions (conv+bias+ReLU, NHWC), then
one attention block on the 28x28 feature map as 784 tokens (Q/K/V projections, SDPA,
output projection with ReLU). Six distinct cuDNN graphs; the Q, K and V projections
share one plan. Its output is checked against the same model in PyTorch.

    python examples/resnet_attention.py            # the start-up demo (needs a GPU)
    python examples/resnet_attention.py --mode warm --dir DIR   # one fresh-process run

The demo runs the model in fresh processes and prints the time to first output with no
plan cache (cuDNN heuristic builds), with a cold plancache, a warm one, a cache that was
just imported from a bundle, and the same model in PyTorch eager (bf16, no plancache).
Beside it, the time of one step once everything is loaded: the median of STEPS steps,
each CUDA-synchronized, timed alone (the float32 reference run that checks the output is
outside every timing).

    python examples/resnet_attention.py --smoke    # the demo at tiny sizes, no GPU needed

``--smoke`` runs the demo's code at tiny sizes (``set_sizes``) on plancache's CPU test
backend, each mode in this process (its result still through JSON), the export through
plancache's command line as the demo does it: a check that the demo runs, measuring
nothing. The no-cache mode (cuDNN Frontend's own heuristic builds) needs a GPU and is
skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

N = 8  # batch
LAYERS: list[tuple[str, str, dict[str, Any]]] = []  # set by set_sizes


def set_sizes(n: int = 8, c: int = 64, hw: int = 56, width: int = 128, heads: int = 2) -> None:
    """The model's sizes (module globals ``N`` and ``LAYERS``): batch ``n``, ``c`` input
    channels of ``hw`` x ``hw``, ``width`` channels after the stride-2 conv, ``heads``
    attention heads over the (hw/2)^2 tokens. The defaults are the model; ``--smoke`` runs
    (scripts/bench_model.py) shrink it."""
    global N, LAYERS
    half, d = hw // 2, width // heads
    N = n
    LAYERS = [
        ("conv1", "conv_bias_act", {"n": n, "c": c, "h": hw, "w": hw, "k": c}),
        ("conv2", "conv_bias_act", {"n": n, "c": c, "h": hw, "w": hw, "k": width, "stride": 2}),
        ("conv3", "conv_bias_act", {"n": n, "c": width, "h": half, "w": half, "k": width}),
        # The projections are one GEMM over the tokens of the whole batch (as PyTorch runs
        # `tokens @ w`): a batch of n GEMMs would need the weight copied n times each step.
        ("proj", "matmul_bias_act", {"b": 1, "m": n * half * half, "k": width, "n": width, "act": None}),
        ("attn", "sdpa", {"b": n, "h": heads, "s": half * half, "d": d, "causal": False}),
        ("out", "matmul_bias_act", {"b": 1, "m": n * half * half, "k": width, "n": width, "act": "relu"}),
    ]


def dims() -> tuple[int, int, int, int, int]:
    """(batch, input channels, tokens, width, heads) of the model as ``LAYERS`` sets it."""
    attn = LAYERS[4][2]
    return N, LAYERS[0][2]["c"], attn["s"], LAYERS[3][2]["k"], attn["h"]


set_sizes()
TOLERANCE = 2e-2
STEPS = 20  # timed steps per run (after WARMUP_STEPS untimed ones); the median is reported
WARMUP_STEPS = 3
MODES = ["nocache", "cold", "warm", "bundle", "eager"]
DEVICE = "cuda"  # where the model runs; "cpu" in a smoke run (the CPU test backend)
SMOKE = False  # a smoke run (--smoke): tiny sizes on the CPU test backend, every mode in this process
SMOKE_SIZES = {"n": 1, "c": 8, "hw": 8, "width": 32, "heads": 2}
#: Modes a smoke run skips, and what of them needs a GPU.
GPU_ONLY_MODES = {"nocache": "cuDNN Frontend's own heuristic builds"}


def start_smoke() -> None:
    """Make this a smoke run: the model at ``SMOKE_SIZES`` on the CPU (the CPU test backend
    runs its plans there), two timed steps after one warm-up."""
    global SMOKE, DEVICE, STEPS, WARMUP_STEPS
    SMOKE, DEVICE, STEPS, WARMUP_STEPS = True, "cpu", 2, 1
    set_sizes(**SMOKE_SIZES)


class RawPlans:
    """No cache: what a user does today, a cuDNN heuristic build for every graph."""

    def __init__(self) -> None:
        import cudnn
        import torch

        self.cudnn, self.torch = cudnn, torch
        self.handle = cudnn.create_handle()
        self.graphs: dict[str, tuple[Any, Any]] = {}

    def run(self, layer: str, name: str, params: dict[str, Any], tensors: dict[int, Any]) -> None:
        from plancache.workflows import templates

        if layer not in self.graphs:
            graph = templates.build(name, handle=self.handle, **params)
            graph.build([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
            size = max(graph.get_workspace_size(), 1)
            self.graphs[layer] = (graph, self.torch.empty(size, dtype=self.torch.uint8, device="cuda"))
        graph, workspace = self.graphs[layer]
        self.cudnn.set_stream(handle=self.handle, stream=self.torch.cuda.current_stream().cuda_stream)
        graph.execute(tensors, workspace, handle=self.handle)


class CachedPlans:
    """plancache: one lookup per layer, built or loaded once per process."""

    def __init__(self, directory: str, backend: Any = None) -> None:
        import plancache

        if backend is None and SMOKE:
            from plancache.testing import CpuTestBackend

            backend = CpuTestBackend()
        self.cache = plancache.PlanCache(directory, backend=backend)
        self.plans: dict[str, Any] = {}

    def run(self, layer: str, name: str, params: dict[str, Any], tensors: dict[int, Any]) -> None:
        from plancache.workflows import templates

        plan = self.plans.get(layer)
        if plan is None:
            plan = self.plans[layer] = self.cache.get(templates.build(name, **params))
        plan.execute(tensors)


def weights(torch: Any, device: str = "cuda", seed: int = 0) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int, scale: float) -> Any:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)

    w: dict[str, Any] = {}
    for layer, _name, p in LAYERS[:3]:
        w[layer] = rnd(p["k"], p["c"], 3, 3, scale=(p["c"] * 9) ** -0.5).to(memory_format=torch.channels_last)
        w[layer + ".b"] = rnd(1, p["k"], 1, 1, scale=0.1)
    width = dims()[3]
    for layer in ("q", "k", "v", "out"):
        w[layer] = rnd(width, width, scale=width**-0.5)
        w[layer + ".b"] = rnd(1, 1, width, scale=0.1)
    return w


def forward(plans: Any, torch: Any, w: dict[str, Any], x: Any) -> Any:
    """The model through cuDNN plans; every tensor is laid out as its template expects, and
    the step launches nothing but the plans (no copies: outputs are made in their layout,
    the weights used as they are)."""

    def empty(shape: tuple[int, ...], channels_last: bool = False) -> Any:
        layout = torch.channels_last if channels_last else torch.contiguous_format
        return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=layout)

    n, _c, s, width, nh = dims()
    h = x
    for layer, name, p in LAYERS[:3]:
        stride = p.get("stride", 1)
        out = empty((n, p["k"], p["h"] // stride, p["w"] // stride), channels_last=True)
        plans.run(layer, name, p, {1: h, 2: w[layer], 3: w[layer + ".b"], 4: out})
        h = out
    tokens = h.permute(0, 2, 3, 1).reshape(1, n * s, width)  # NHWC memory: a view, no copy
    _, proj, pp = LAYERS[3]
    qkv = {}
    for part in ("q", "k", "v"):
        qkv[part] = empty((1, n * s, width))
        plans.run("proj", proj, pp, {1: tokens, 2: w[part].unsqueeze(0), 3: w[part + ".b"], 4: qkv[part]})
    heads = {part: t.view(n, s, nh, width // nh).permute(0, 2, 1, 3) for part, t in qkv.items()}  # BSHD memory
    o = empty((n, s, nh, width // nh)).permute(0, 2, 1, 3)
    _, attn, ap = LAYERS[4]
    plans.run("attn", attn, ap, {1: heads["q"], 2: heads["k"], 3: heads["v"], 4: o})
    attended = o.permute(0, 2, 1, 3).reshape(1, n * s, width)
    out = empty((1, n * s, width))
    _, proj_out, op = LAYERS[5]
    plans.run("out", proj_out, op, {1: attended, 2: w["out"].unsqueeze(0), 3: w["out.b"], 4: out})
    return out.view(n, s, width)


def forward_eager(torch: Any, w: dict[str, Any], x: Any) -> Any:
    """The same model in PyTorch eager, in bf16 and the same memory layouts as the cuDNN
    graphs: what the model costs without plancache (PyTorch picks its own kernels)."""
    functional = torch.nn.functional
    n, _c, s, width, nh = dims()
    h = x
    for layer, _name, p in LAYERS[:3]:
        h = torch.relu(functional.conv2d(h, w[layer], padding=1, stride=p.get("stride", 1)) + w[layer + ".b"])
    tokens = h.permute(0, 2, 3, 1).reshape(n, s, width)
    q, k, v = (tokens @ w[p] + w[p + ".b"] for p in ("q", "k", "v"))
    split = lambda t: t.view(n, s, nh, width // nh).permute(0, 2, 1, 3)  # noqa: E731
    o = functional.scaled_dot_product_attention(split(q), split(k), split(v), scale=(width // nh) ** -0.5)
    return torch.relu(o.permute(0, 2, 1, 3).reshape(n, s, width) @ w["out"] + w["out.b"])


def forward_pytorch(torch: Any, w: dict[str, Any], x: Any) -> Any:
    """The same model in PyTorch, float32 from the same bf16 weights."""
    functional = torch.nn.functional
    n, _c, s, width, nh = dims()
    h = x.float()
    for layer, _name, p in LAYERS[:3]:
        h = torch.relu(functional.conv2d(h, w[layer].float(), padding=1, stride=p.get("stride", 1)) + w[layer + ".b"].float())
    tokens = h.permute(0, 2, 3, 1).reshape(n, s, width)
    q, k, v = (tokens @ w[p].float() + w[p + ".b"].float() for p in ("q", "k", "v"))
    split = lambda t: t.view(n, s, nh, width // nh).permute(0, 2, 1, 3)  # noqa: E731
    o = functional.scaled_dot_product_attention(split(q), split(k), split(v), scale=(width // nh) ** -0.5)
    return torch.relu(o.permute(0, 2, 1, 3).reshape(n, s, width) @ w["out"].float() + w["out.b"].float())


def synchronize(torch: Any) -> None:
    """``torch.cuda.synchronize()`` where the model runs on the GPU (``DEVICE``)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def step_times_ms(torch: Any, step: Any, steps: int | None = None, warmup: int | None = None) -> list[float]:
    """Milliseconds of each of ``steps`` (``STEPS``) calls of ``step`` after ``warmup``
    (``WARMUP_STEPS``) untimed ones. Each is timed alone and waits for the GPU
    (``torch.cuda.synchronize``), so it is what a caller waiting for one output pays: host
    launch work plus GPU time."""
    for _ in range(WARMUP_STEPS if warmup is None else warmup):
        step()
    synchronize(torch)
    times = []
    for _ in range(STEPS if steps is None else steps):
        started = time.perf_counter()
        step()
        synchronize(torch)
        times.append((time.perf_counter() - started) * 1e3)
    return times


def cuda_torch() -> Any:
    """torch, once it is clear that there is a GPU (else one line and exit code 1); in a
    smoke run, torch without one."""
    import torch

    if SMOKE:
        return torch
    if not torch.cuda.is_available():
        raise SystemExit(
            "resnet_attention.py: this runs cuDNN plans and needs an NVIDIA GPU (torch.cuda.is_available() is False); "
            "without one, `python -m pytest tests/test_example.py` runs the model through plancache on the CPU test backend"
        )
    torch.cuda.init()
    return torch


def run_once(mode: str, directory: str | None, bundle: str | None) -> dict[str, Any]:
    if SMOKE and mode in GPU_ONLY_MODES:
        return {"mode": mode, "skipped": f"needs a GPU ({GPU_ONLY_MODES[mode]})"}
    torch = cuda_torch()
    w = weights(torch, device=DEVICE)
    c, hw = LAYERS[0][2]["c"], LAYERS[0][2]["h"]
    x = torch.randn(N, c, hw, hw).to(torch.bfloat16).to(DEVICE).to(memory_format=torch.channels_last)
    synchronize(torch)
    started = time.perf_counter()
    imported = None
    plans: Any = None
    if mode == "bundle":
        from plancache.store import Store
        from plancache.workflows.bundle import import_bundle

        # The bundle this run exported a moment ago, unsigned unless a fleet secret is set.
        imported = import_bundle(Store(directory), bundle or "", allow_unsigned=True)
    if mode == "eager":
        step = lambda: forward_eager(torch, w, x)  # noqa: E731
    else:
        plans = RawPlans() if mode == "nocache" else CachedPlans(directory or "")
        step = lambda: forward(plans, torch, w, x)  # noqa: E731
    out = step()
    synchronize(torch)
    first = time.perf_counter() - started
    times = step_times_ms(torch, step)
    ref = forward_pytorch(torch, w, x)  # float32, after the timings: checks the output only
    error = float((out.float() - ref).norm() / ref.norm())
    result = {"mode": mode, "first_output_s": first, "step_ms": statistics.median(times), "step_ms_min": min(times),
              "steps": len(times), "rel_error": error}  # fmt: skip
    if isinstance(plans, CachedPlans):
        plans.cache.close()
        result["counters"] = plans.cache.counters
    if imported is not None:
        result["imported"] = {k: (len(v) if isinstance(v, list) else v) for k, v in dict(imported).items()}
    return result


def demo(opts_out: str | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="plancache-example-") as root:  # its caches and bundle: gone at the end
        _demo(Path(root), opts_out)


def _demo(root: Path, opts_out: str | None) -> None:
    warm, imported, bundle = root / "warm", root / "imported", root / "plans.bundle"

    def fresh(mode: str, directory: Path | None = None) -> dict[str, Any]:
        args = [sys.executable, __file__, "--mode", mode]
        if directory is not None:
            args += ["--dir", str(directory)]
        if mode == "bundle":
            args += ["--bundle", str(bundle)]
        started = time.perf_counter()
        if SMOKE:  # in this process, its result through JSON as a child's stdout
            found: dict[str, Any] = json.loads(json.dumps(run_once(mode, str(directory or ""), str(bundle))))
            found["process_s"] = time.perf_counter() - started
            return found
        out = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            sys.stderr.write(out.stderr[-3000:])
            raise SystemExit(f"mode {mode} failed")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["process_s"] = time.perf_counter() - started
        return result

    rows = [fresh("nocache"), fresh("cold", warm), fresh("warm", warm)]
    export = subprocess.run([sys.executable, "-m", "plancache", "--dir", str(warm), "export", str(bundle), "--json"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    if export.returncode != 0:
        sys.stderr.write(export.stderr)
        raise SystemExit("export failed")
    rows.append(fresh("bundle", imported))
    rows.append(fresh("eager"))
    where = "in this process (a smoke run on the CPU test backend: it measures nothing)" if SMOKE else "in a fresh process"
    print(f"\nexample model (3 fused convs + attention block, batch {N}, bf16): time to first output {where};")
    print(f"step: median of {STEPS} steps after {WARMUP_STEPS} warm-up steps, each CUDA-synchronized and timed alone")
    print(f"{'mode':10} {'first output s':>15} {'step ms':>9} {'process s':>10} {'rel err':>9}  counters")
    for r in rows:
        if "skipped" in r:  # a smoke run's GPU-only mode
            print(f"{r['mode']:10} skipped: {r['skipped']}")
            continue
        counters = {k: v for k, v in r.get("counters", {}).items() if v}
        print(
            f"{r['mode']:10} {r['first_output_s']:15.3f} {r['step_ms']:9.3f} {r['process_s']:10.1f} {r['rel_error']:9.1e}  {counters}"
        )
    print("eager: the same model in PyTorch (bf16, its own kernels), no plancache")
    bad = [r["mode"] for r in rows if "skipped" not in r and r["rel_error"] > TOLERANCE]
    if bad:
        raise SystemExit(f"outputs differ from PyTorch in modes {bad}")
    if opts_out:
        Path(opts_out).write_text(json.dumps(rows, indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode", choices=MODES, help="one run in this process, printed as JSON (the demo runs each in a fresh one)"
    )
    parser.add_argument("--dir", help="the plan cache directory (modes cold, warm, bundle)")
    parser.add_argument("--bundle", help="the bundle to import first (mode bundle)")
    parser.add_argument("--out", help="the demo's rows as JSON (also accepted so scripts/gpu-check can run every demo alike)")
    parser.add_argument("--smoke", action="store_true", help="the demo at tiny sizes on plancache's CPU test backend, "
                        "every mode in this process (no GPU needed): checks that it runs, measures nothing")  # fmt: skip
    opts = parser.parse_args(argv)
    if opts.smoke:
        start_smoke()
    if opts.mode in ("cold", "warm", "bundle") and not opts.dir:
        parser.error(f"--mode {opts.mode} needs --dir DIR (the plan cache directory)")
    if opts.mode == "bundle" and not opts.bundle:
        parser.error("--mode bundle needs --bundle FILE")
    if opts.mode:
        print(json.dumps(run_once(opts.mode, opts.dir, opts.bundle)))
        return
    cuda_torch()  # the demo needs a GPU: one line and exit code 1 without one
    demo(opts.out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
