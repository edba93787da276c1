"""GPU tests of the launch path, whole-step capture and auto-prime on real cuDNN plans.

* A stored plan loads and launches through cuDNN's C API (``guest.native``); its outputs
  must equal, bit for bit, those of the frontend's own ``execute`` of the same engine, for
  every template, and a plan this process autotuned (which keeps the frontend's path) too.
* The example model's step captured with ``plancache.capture`` gives the eager step's
  output, and again after new inputs are copied in.
* A fresh process of an application primes the plans its previous run used while it
  "loads weights", and its lookups are then memory hits with correct outputs.

Skipped without CUDA; run by scripts/gpu-check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

import plancache  # noqa: E402
from plancache.workflows import templates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-2
GRAPHS: list[tuple[str, dict[str, Any]]] = [
    ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64}),
    ("conv_bias_act", {"n": 16, "c": 256, "h": 28, "w": 28, "k": 256, "bias": False, "act": None}),
    ("matmul_bias_act", {"b": 4, "m": 256, "n": 512, "k": 256}),
    ("matmul_bias_act", {"b": 1, "m": 128, "n": 128, "k": 65536, "bias": False, "act": None}),
    ("sdpa", {"b": 2, "h": 4, "s": 512, "d": 64, "causal": True}),
    ("sdpa", {"b": 1, "h": 8, "s": 1024, "d": 128, "causal": False}),
]


def relative_error(out: Any, ref: Any) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def frontend_output(blob: bytes, workspace_size: int, name: str, params: dict[str, Any]) -> Any:
    """The output of the frontend's own deserialize and execute of ``blob`` on the template tensors."""
    import cudnn

    tensors = templates.allocate(name, device="cuda", **params)
    tensors[4].fill_(float("nan"))
    handle = cudnn.create_handle()  # its warm-up on a stream of its own, never the current one
    graph = cudnn.pygraph(handle=handle)
    graph.deserialize(blob)
    torch.cuda.synchronize()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device="cuda")
    graph.execute(tensors, workspace, handle=handle)
    torch.cuda.synchronize()
    return tensors[4].clone()


@pytest.mark.parametrize(("name", "params"), GRAPHS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(GRAPHS)])
def test_a_loaded_plan_launches_through_cudnns_api_exactly_as_the_frontend_executes_it(tmp_path: Path, name: str,
                                                                                      params: dict[str, Any]) -> None:  # fmt: skip
    from plancache.guest.native import NativePlan

    builder = plancache.PlanCache(tmp_path, auto_prime=False)
    built = builder.get(templates.build(name, **params))
    assert isinstance(built.native, NativePlan), (
        "a plan autotuned here runs as loaded back from its blob, as later processes run it"
    )
    cache = plancache.PlanCache(tmp_path, auto_prime=False)
    plan = cache.get(templates.build(name, **params))
    assert plan.source == "loaded" and isinstance(plan.native, NativePlan), "a stored plan loads through cuDNN's C API"
    assert cache.stats()["process"]["native_fallbacks"] == 0
    entry = cache.store.get(plan.key)
    assert entry is not None
    expected = frontend_output(entry.blob, plan.workspace_size, name, params)  # the frontend's own execute of the same plan
    for which in (plan, built):
        tensors = templates.allocate(name, device="cuda", **params)
        tensors[4].fill_(float("nan"))
        for _ in range(3):  # repeated launches, each with a workspace of its own
            which.execute(tensors)
        torch.cuda.synchronize()
        assert torch.equal(tensors[4], expected), f"{which.source} plan: outputs differ from the frontend's execute"
        assert relative_error(tensors[4], templates.reference(name, tensors, **params)) < TOLERANCE
    builder.close()
    cache.close()


def test_a_launch_follows_the_callers_stream_from_one_launch_to_the_next(tmp_path: Path) -> None:
    """The pooled handle is pointed at each launch's stream: work queued before the launch
    on that stream is seen, work after it sees the result."""
    name, params = GRAPHS[2]
    plancache.PlanCache(tmp_path, auto_prime=False).get(templates.build(name, **params))
    plan = plancache.PlanCache(tmp_path, auto_prime=False).get(templates.build(name, **params))
    tensors = templates.allocate(name, device="cuda", **params)
    reference = templates.reference(name, tensors, **params)
    for stream in (torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.current_stream()):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(5_000_000)  # a few ms of GPU time queued on this stream first
            tensors[4].fill_(float("nan"))
            plan.execute(tensors)
            result = tensors[4].clone()
        stream.synchronize()
        assert relative_error(result, reference) < TOLERANCE


def _example() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import resnet_attention
    finally:
        sys.path.pop(0)
    return resnet_attention


def test_the_example_step_captured_in_one_cuda_graph_gives_the_eager_output(tmp_path: Path) -> None:
    example = _example()
    plans = example.CachedPlans(str(tmp_path))
    w = example.weights(torch)
    x = torch.randn(example.N, 64, 56, 56, device="cuda").to(torch.bfloat16).to(memory_format=torch.channels_last)
    eager = example.forward(plans, torch, w, x).clone()
    captured = plancache.capture(lambda: example.forward(plans, torch, w, x))
    out = captured.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "a replay computes what the uncaptured step computes"
    x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))
    fresh = example.forward(plans, torch, w, x).clone()
    assert not torch.equal(fresh, eager)
    captured.output.fill_(float("nan"))
    out = captured.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fresh), "a replay reads the inputs copied in since the capture"
    reference = example.forward_pytorch(torch, w, x)
    assert relative_error(out, reference) < 2e-2
    plans.cache.close()


CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import plancache
    from plancache.workflows import templates
    GRAPHS = json.loads(sys.argv[2])
    cache = plancache.PlanCache(sys.argv[1])  # auto-prime as configured by the environment
    torch.zeros(1, device="cuda")  # the program sets its device up (the primer waits for that)
    torch.cuda.synchronize()
    time.sleep(float(sys.argv[3]))  # stands in for loading weights
    errors = []
    for name, params in GRAPHS:
        plan = cache.get(templates.build(name, **params))
        tensors = templates.allocate(name, device="cuda", **params)
        plan.execute(tensors)
        torch.cuda.synchronize()
        ref = templates.reference(name, tensors, **params)
        errors.append(float((tensors[4].float() - ref.float()).norm() / ref.float().norm()))
    report = cache.primer.report if cache.primer is not None else None
    cache.close()
    print(json.dumps({"counters": cache.counters, "primer": report, "errors": errors}))
    """
)


def test_a_fresh_process_primes_what_its_last_run_used(tmp_path: Path) -> None:
    env = {**os.environ, "PLANCACHE_APP": "gpu-test-app", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    graphs = json.dumps(GRAPHS[:3] + GRAPHS[4:5])

    def run(auto_prime: str, pause: float) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), graphs, str(pause)],
                              env={**env, "PLANCACHE_AUTO_PRIME": auto_prime}, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold = run("1", 0.0)
    assert cold["counters"]["builds"] == 4 and cold["primer"]["primed"] == 0
    warm = run("1", 3.0)
    assert warm["primer"]["primed"] == 4 and warm["primer"]["skipped"] == {}, warm["primer"]
    assert warm["counters"]["memory_hits"] == 4 and warm["counters"]["hits"] == 0 and warm["counters"]["builds"] == 0
    assert max(warm["errors"]) < TOLERANCE
    off = run("0", 0.0)  # turned off: no primer, every lookup loads from the store (use is still recorded)
    assert off["primer"] is None and off["counters"]["hits"] == 4 and off["counters"]["primed"] == 0
    default = run("", 3.0)  # unset: on by default, priming what the run before (the one turned off) used
    assert default["primer"] is not None and default["primer"]["primed"] == 4, default["primer"]
    assert default["counters"]["memory_hits"] == 4 and default["counters"]["hits"] == 0


TWO_DEVICE_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import plancache
    from plancache.workflows import templates
    from plancache.cudnn.library import libcuda
    name, params = json.loads(sys.argv[2])
    if sys.argv[3] == "record":  # the last run: it used device 1
        torch.cuda.set_device(1)
        cache = plancache.PlanCache(sys.argv[1], auto_prime=False)
        cache.get(templates.build(name, **params))
        cache.close()
        print(json.dumps({"recorded": True}))
        sys.exit(0)
    cache = plancache.PlanCache(sys.argv[1])  # auto-prime on
    torch.zeros(1, device="cuda:0")  # this run has only used device 0 so far
    time.sleep(2.0)
    before = {"device_1_context": libcuda().primary_context_active(1), "primer_alive": cache.primer.is_alive(),
              "primed": cache.counters["primed"]}
    torch.cuda.set_device(1)
    torch.zeros(1, device="cuda:1")  # now it uses device 1: the primer may load there
    cache.primer.join(timeout=60)
    plan = cache.get(templates.build(name, **params))
    print(json.dumps({"before": before, "report": cache.primer.report, "counters": cache.counters, "device": plan.device}))
    """
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (torch.cuda.device_count() < 2)")
def test_the_primer_creates_no_context_on_a_device_the_process_has_not_used(tmp_path: Path) -> None:
    env = {**os.environ, "PLANCACHE_APP": "gpu-test-devices", "PLANCACHE_AUTO_PRIME": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}  # fmt: skip
    graph = json.dumps(GRAPHS[2])

    def run(step: str) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-c", TWO_DEVICE_CHILD, str(tmp_path), graph, step], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    run("record")
    result = run("prime")
    assert result["before"] == {"device_1_context": False, "primer_alive": True, "primed": 0}, result
    assert result["report"]["primed"] == 1 and result["counters"]["memory_hits"] == 1 and result["device"] == 1, result
